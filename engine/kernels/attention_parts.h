/*
 * Pieces both attention paths share (paged_attention.c: one token, all heads; prefill_attention.c:
 * query blocks): walking a sequence's key rows through its block table, the softmax, and the
 * bf16 V-weighted sum. Static inline; included once per .c file.
 */
#ifndef DUET_KERNELS_ATTENTION_PARTS_H
#define DUET_KERNELS_ATTENTION_PARTS_H

#include "common.h"
#include "step.h"
#include "vec8.h"

#define TILE 16

/* Pointers to the rows (K, or V with `kv` = 1) of the keys [start, start + n) of one kv head. */
typedef struct {
    const char *base; /* pool + layer + kv head, in bytes */
    const int64_t *table;
    int64_t block_bytes, tok_bytes;
    int bs, blk, off;
} RowIter;

/* Bytes of one pool element, and elements of one kv head's row (int8: the values, then the scale). */
INLINE int64_t kv_esz(const Step *s) { return s->kv_int8 ? 1 : s->bf16 ? 2 : 4; }
INLINE int64_t kv_row(const Step *s) { return s->head_dim + (s->kv_int8 ? 4 : 0); }

INLINE void rows_init(RowIter *it, const Step *s, int layer, int row, int kh, int kv, int start) {
    const int64_t esz = kv_esz(s), rw = kv_row(s);
    const int64_t tok = (int64_t)s->num_kv_heads * rw;
    it->base = (const char *)s->cache + esz * (layer * s->layer_stride + kv * s->block_size * tok + (int64_t)kh * rw);
    it->table = s->block_tables + (int64_t)row * s->table_width;
    it->block_bytes = esz * s->block_stride;
    it->tok_bytes = esz * tok;
    it->bs = s->block_size;
    it->blk = start / s->block_size; /* the only division: later rows step through the table */
    it->off = start % s->block_size;
}

INLINE const void *rows_next(RowIter *it) {
    const void *p = it->base + it->table[it->blk] * it->block_bytes + it->off * it->tok_bytes;
    if (++it->off == it->bs) { it->off = 0; it->blk++; }
    return p;
}

#if defined(__AVX512F__)
/* In place: s[0..n) = exp(s - max); returns 1 / sum. */
INLINE float softmax_unnormalized(float *s, int n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, k, s + j));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mx));
        _mm512_mask_storeu_ps(s + j, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}
#endif

#if defined(DUET_VEC8)
/* In place: s[0..n) = exp(s - max); returns 1 / sum (AVX2: softmax_unnormalized's arithmetic in
 * 8 lanes). `round` (bf16 steps): the weights are stored rounded to bf16 while the sum is of the
 * unrounded exps, where torch's CPU flash attention (SDPA, the bf16 oracle's) rounds: its P.V
 * GEMM takes bf16 weights and its output is divided by the fp32 sum. Weights kept in fp32 moved
 * the bf16 engine's greedy tokens away from transformers' at near-ties (SmolLM2, 8 chats x 16
 * tokens: 85 of 128 agreeing with transformers bf16 instead of 110). */
INLINE float softmax8(float *s, int n, const int round) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
    float mx = vec8_hmax(m);
    for (int i = j; i < n; i++) mx = fmaxf(mx, s[i]);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = vec8_exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
        _mm256_storeu_ps(s + j, round ? vec8_round_bf16_finite(e) : e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < n) {
        const __m256i k = vec8_mask(n - j);
        const __m256 e = _mm256_and_ps(vec8_exp(_mm256_sub_ps(_mm256_maskload_ps(s + j, k), vmx)), _mm256_castsi256_ps(k));
        _mm256_maskstore_ps(s + j, k, round ? vec8_round_bf16_finite(e) : e);
        sum = _mm256_add_ps(sum, e);
    }
    return 1.0f / hsum8(sum);
}

#endif

#if defined(DUET_AVX2)
/* out[g] dims [d0, d0 + 8 nv) = inv[g] * sum_j pr[g][j pstep] V_j for ng <= 3 rows of weights (fp32,
 * zero past a row's own keys), V_j at rp[j] + voff (bytes), nv 2 or 4 vectors: 3 x 4 accumulators
 * in registers. bf16 V is widened in pairs (vec8_load_pairs) and put back in order at the store.
 * ng, nv and bf16 are constants here (pv_pass8 dispatches): tested at run time inside the loop,
 * they kept the accumulators on the stack. */
INLINE void pv_pass8_k(const char *const *rp, int64_t voff, int n, const float *const *pr, int64_t pstep,
                       const float *inv, const int ng, int d0, const int nv, void *const *orow, const int bf16) {
    __m256 acc[3][4];
    for (int g = 0; g < 3; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        __m256 w[3];
        for (int g = 0; g < ng; g++) w[g] = _mm256_broadcast_ss(pr[g] + j * pstep);
        const char *v = rp[j] + voff;
        if (bf16) {
            for (int c = 0; c < nv; c += 2) {
                __m256 a, b;
                vec8_load_pairs((const uint16_t *)v + d0 + 8 * c, &a, &b);
                for (int g = 0; g < ng; g++) {
                    acc[g][c] = _mm256_fmadd_ps(w[g], a, acc[g][c]);
                    acc[g][c + 1] = _mm256_fmadd_ps(w[g], b, acc[g][c + 1]);
                }
            }
        } else { /* one vector live at a time: 12 accumulators, 3 weights and it fill the 16 registers */
            for (int c = 0; c < nv; c++) {
                const __m256 a = _mm256_loadu_ps((const float *)v + d0 + 8 * c);
                for (int g = 0; g < ng; g++) acc[g][c] = _mm256_fmadd_ps(w[g], a, acc[g][c]);
            }
        }
    }
    for (int g = 0; g < ng; g++) {
        const __m256 sc = _mm256_set1_ps(inv[g]);
        for (int c = 0; c < nv; c += 2) {
            __m256 lo = acc[g][c], hi = acc[g][c + 1];
            if (bf16) vec8_interleave(lo, hi, &lo, &hi);
            store8(orow[g], d0 + 8 * c, _mm256_mul_ps(lo, sc), bf16);
            store8(orow[g], d0 + 8 * c + 8, _mm256_mul_ps(hi, sc), bf16);
        }
    }
}

static void pv_pass8(const char *const *rp, int64_t voff, int n, const float *const *pr, int64_t pstep,
                     const float *inv, int ng, int d0, int nv, void *const *orow, int bf16) {
#define PV8(NG, NV, B) pv_pass8_k(rp, voff, n, pr, pstep, inv, NG, d0, NV, orow, B)
#define PV8_NG(NV, B)                                                                                               \
    switch (ng) {                                                                                                   \
    case 1: PV8(1, NV, B); break;                                                                                   \
    case 2: PV8(2, NV, B); break;                                                                                   \
    default: PV8(3, NV, B); break;                                                                                  \
    }
    if (bf16) { /* two vectors of a pair live: 16 dims a pass keep 3 rows' accumulators in registers */
        for (int c = 0; c < nv; c += 2, d0 += 16) PV8_NG(2, 1)
    } else {
        if (nv == 4) { PV8_NG(4, 0) } else { PV8_NG(2, 0) }
    }
#undef PV8_NG
#undef PV8
}
#endif

#if defined(__AVX512BF16__)
/* kt[p] (p < D/2) = the p-th bf16 pair of each of the 16 key rows kp[i]. */
INLINE void transpose_tile(const char *const *kp, int D, __m512i *kt) {
    for (int c = 0; c < D / 32; c++) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const uint16_t *)kp[i] + 32 * c);
        transpose16(r);
        for (int i = 0; i < 16; i++) kt[16 * c + i] = r[i];
    }
}

/* p rounded to bf16 into pb[0..n) (pb[n] = 0, so keys pair up); returns 1 / (sum of the
 * rounded p), so the output is normalized by exactly the weights it used. */
INLINE float probs_bf16(const float *p, int n, uint16_t *pb) {
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m256i h = cvt16_bf16(_mm512_maskz_loadu_ps(k, p + j));
        _mm256_mask_storeu_epi16(pb + j, k, h);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    pb[n] = 0;
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* bf16 V-weighted sum, two keys per dpbf16: rows j and j+1 are interleaved 16 bits apart
 * (unpacklo/hi, which permutes dims within 128-bit lanes; undone at the store), weights are
 * the bf16 pair (p_j, p_j+1) broadcast. Up to 4 rows (p row r at pr[r], zero from its own
 * length to n, output at orow[r]) x 64 dims starting at d0; nc = 32-dim chunks (1 or 2). */
INLINE void pv_pass_bf16(const char *const *rp, int64_t voff, int n, const uint16_t *const *pr,
                         const float *inv, int ng, int d0, int nc, uint16_t *const *orow) {
    __m512 acc[4][4];
    for (int g = 0; g < 4; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 2) {
        const uint16_t *a = (const uint16_t *)(rp[j] + voff) + d0;
        const uint16_t *b = j + 1 < n ? (const uint16_t *)(rp[j + 1] + voff) + d0 : a; /* p = 0 there */
        __m512i v[4];
        for (int c = 0; c < 2; c++) {
            if (c >= nc) break;
            const __m512i x = _mm512_loadu_si512(a + 32 * c), y = _mm512_loadu_si512(b + 32 * c);
            v[2 * c] = _mm512_unpacklo_epi16(x, y);
            v[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < 4; g++) {
            if (g >= ng) break;
            int32_t w2;
            __builtin_memcpy(&w2, pr[g] + j, sizeof w2);
            const __m512bh w = (__m512bh)_mm512_set1_epi32(w2);
            for (int c = 0; c < 4; c++)
                if (c < 2 * nc) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], w, (__m512bh)v[c]);
        }
    }
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < ng; g++) {
        const __m512 sc = _mm512_set1_ps(inv[g]);
        for (int c = 0; c < nc; c++) {
            const __m512 x = acc[g][2 * c], y = acc[g][2 * c + 1];
            const int64_t o = d0 + 32 * c;
            store16(orow[g], o, _mm512_mul_ps(_mm512_permutex2var_ps(x, lo, y), sc), 1);
            store16(orow[g], o + 16, _mm512_mul_ps(_mm512_permutex2var_ps(x, hi, y), sc), 1);
        }
    }
}
#endif

#endif
