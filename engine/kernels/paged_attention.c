/*
 * Paged attention on the CPU for any token of a step (a decode, or a prefill token with or
 * without a cached prefix), reading K/V in place from the block-major pool.
 *
 * A work item is one token, all heads: its keys' rows (all kv heads of a key are contiguous) are
 * streamed once, with the next tile prefetched, which matters more than arithmetic once the
 * blocks of a paged pool are scattered in DRAM (3.4x measured at 32 x 280 keys). Scores are computed 16 keys at a time (one vector of partial
 * dot products per key, then one transpose-reduce for the 16, instead of a horizontal
 * reduction per key); with AVX512-BF16 the q.k products are `dpbf16` on the raw bf16 pool.
 * The softmax is two-pass in fp32 with a vectorized exp; the V-weighted sum accumulates in
 * fp32 registers (4 heads x 64 dims per pass) and is normalized once at the end.
 *
 * Invariants: the step's new K/V are already in the pool (rope_store ran); scores never read
 * past a token's context; results equal softmax(q.K^T * scale).V up to fp32 rounding.
 * Threads: OpenMP, resolved against the libgomp torch already loaded (one thread pool).
 */
#include <stdlib.h>

#include "attention_parts.h"

#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#ifndef PF_DIST
#define PF_DIST 1
#endif

#if defined(__AVX512F__)
/* dst[i] = scale * q . k_i for the 16 keys `kp` (D % 16 == 0; D % 32 == 0 for dpbf16). */
INLINE void qk_tile(const void *q, const void *const *kp, int D, float scale, float *dst, int bf16) {
    __m512 acc[TILE];
    for (int i = 0; i < TILE; i++) acc[i] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (bf16 && (D & 31) == 0) {
        for (int d = 0; d < D; d += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512((const uint16_t *)q + d);
            for (int i = 0; i < TILE; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512((const uint16_t *)kp[i] + d));
        }
        _mm512_storeu_ps(dst, _mm512_mul_ps(transpose_reduce16(acc), _mm512_set1_ps(scale)));
        return;
    }
#endif
    for (int d = 0; d < D; d += 16) {
        const __m512 qv = load16(q, d, bf16);
        for (int i = 0; i < TILE; i++) acc[i] = _mm512_fmadd_ps(qv, load16(kp[i], d, bf16), acc[i]);
    }
    _mm512_storeu_ps(dst, _mm512_mul_ps(transpose_reduce16(acc), _mm512_set1_ps(scale)));
}

/* out[g] = inv[g] * sum_j p[g][j] V_j over up to 4 heads and 64 dims starting at d0. */
INLINE void pv_pass(const Step *s, int layer, int row, int kh, int start, int n, const float *p, int64_t pstride,
                    const float *inv, int ng, int d0, int nv, void *out, int bf16) {
    __m512 acc[4][4];
    for (int g = 0; g < 4; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    RowIter it;
    rows_init(&it, s, layer, row, kh, 1, start);
    for (int j = 0; j < n; j++) {
        const void *vp = rows_next(&it);
        __m512 v[4];
        for (int c = 0; c < 4; c++) v[c] = c < nv ? load16(vp, d0 + 16 * c, bf16) : _mm512_setzero_ps();
        for (int g = 0; g < 4; g++) {
            if (g >= ng) break;
            const __m512 w = _mm512_set1_ps(p[g * pstride + j]);
            for (int c = 0; c < 4; c++)
                if (c < nv) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
    }
    const int D = s->head_dim;
    for (int g = 0; g < ng; g++)
        for (int c = 0; c < nv; c++)
            store16(out, (int64_t)g * D + d0 + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])), bf16);
}
#endif

/* Portable path (no AVX-512, or head_dim not a multiple of 16). */
INLINE void attend_scalar(const Step *s, int layer, int row, int kh, int start, int n, const void *q, float *sc,
                          int64_t pstride, void *out, int bf16) {
    const int D = s->head_dim, G = s->num_heads / s->num_kv_heads;
    for (int g = 0; g < G; g++) {
        const int64_t qo = (int64_t)(kh * G + g) * D;
        float *p = sc + (int64_t)(kh * G + g) * pstride;
        RowIter it;
        rows_init(&it, s, layer, row, kh, 0, start);
        float m = -INFINITY;
        for (int j = 0; j < n; j++) {
            const void *kp = rows_next(&it);
            float d = 0.f;
            for (int e = 0; e < D; e++) d += load_elem(q, qo + e, bf16) * load_elem(kp, e, bf16);
            p[j] = d * s->scale;
            m = fmaxf(m, p[j]);
        }
        float sum = 0.f;
        for (int j = 0; j < n; j++) { p[j] = expf(p[j] - m); sum += p[j]; }
        float acc[1024];
        for (int e0 = 0; e0 < D; e0 += 1024) {
            const int ne = D - e0 < 1024 ? D - e0 : 1024;
            for (int e = 0; e < ne; e++) acc[e] = 0.f;
            rows_init(&it, s, layer, row, kh, 1, start);
            for (int j = 0; j < n; j++) {
                const void *vp = rows_next(&it);
                for (int e = 0; e < ne; e++) acc[e] += p[j] * load_elem(vp, e0 + e, bf16);
            }
            for (int e = 0; e < ne; e++) store_elem(out, (int64_t)(kh * G + g) * D + e0 + e, acc[e] / sum, bf16);
        }
    }
}

/* Every head of token t: its K/V rows are read whole (all kv heads of a key are one contiguous
 * row, a block's rows one contiguous run), and the next tile of K and V is prefetched, so the
 * scattered blocks of a paged pool stream at close to memory bandwidth. */
INLINE void attend(const Step *s, int layer, int t, const void *q, void *out, float *sc, uint16_t *pb,
                   const char **rp, int bf16) {
    const int ctx = s->ctx_lens[t];
    const int start = (s->window > 0 && ctx > s->window) ? ctx - s->window : 0;
    const int n = ctx - start, row = s->token_row[t];
    const int D = s->head_dim, KVH = s->num_kv_heads, G = s->num_heads / s->num_kv_heads;
    const int64_t pstride = (int64_t)s->max_ctx + TILE;
#if defined(__AVX512F__)
    if ((D & 15) == 0) {
        const int64_t esz = bf16 ? 2 : 4, row_bytes = esz * KVH * D, v_bytes = esz * s->block_size * KVH * D;
        /* Row addresses of all the token's keys, then tiles of 16; the lines of the tile
         * PF_DIST ahead are prefetched a few lines of each row per head (a burst of ~200
         * prefetches would stall on the few outstanding-miss buffers). */
        RowIter it;
        rows_init(&it, s, layer, row, 0, 0, start);
        for (int i = 0; i < n; i++) rp[i] = (const char *)rows_next(&it);
        const int row_lines = (int)((row_bytes + 63) / 64);
        const int lines_per_head = (2 * row_lines + KVH * G - 1) / (KVH * G);
        for (int j = 0; j < n; j += TILE) {
            const int cnt = n - j < TILE ? n - j : TILE;
            const char *kp[TILE];
            for (int i = 0; i < cnt; i++) kp[i] = rp[j + i];
            for (int i = cnt; i < TILE; i++) kp[i] = kp[0]; /* padding lanes, never read back */
            const int pj = j + PF_DIST * TILE, pcnt = n - pj < TILE ? n - pj : TILE;
            for (int kh = 0; kh < KVH; kh++) {
                const void *kt[TILE];
                for (int i = 0; i < TILE; i++) kt[i] = kp[i] + esz * kh * D;
                for (int g = 0; g < G; g++) {
                    const int h = kh * G + g;
                    for (int c = h * lines_per_head; c < (h + 1) * lines_per_head && c < 2 * row_lines; c++) {
                        const int64_t off = c < row_lines ? 64 * c : v_bytes + 64 * (c - row_lines);
                        for (int r = 0; r < pcnt; r++) _mm_prefetch(rp[pj + r] + off, PF_HINT);
                    }
                    qk_tile((const char *)q + esz * h * D, kt, D, s->scale, sc + h * pstride + j, bf16);
                }
            }
        }
        float inv[64];
        for (int kh = 0; kh < KVH; kh++) {
            for (int g = 0; g < G; g++) inv[g] = softmax_unnormalized(sc + (kh * G + g) * pstride, n);
#if defined(__AVX512BF16__)
            if (bf16 && (D & 31) == 0) {
                for (int g = 0; g < G; g++)
                    inv[g] = probs_bf16(sc + (kh * G + g) * pstride, n, pb + (kh * G + g) * pstride);
                const int64_t voff = v_bytes + esz * kh * D;
                for (int g0 = 0; g0 < G; g0 += 4) {
                    const int ng = G - g0 < 4 ? G - g0 : 4, h0 = kh * G + g0;
                    const uint16_t *pr[4];
                    uint16_t *orow[4];
                    for (int g = 0; g < ng; g++) {
                        pr[g] = pb + (h0 + g) * pstride;
                        orow[g] = (uint16_t *)out + (int64_t)(h0 + g) * D;
                    }
                    for (int d0 = 0; d0 < D; d0 += 64) {
                        const int nc = (D - d0) / 32 < 2 ? (D - d0) / 32 : 2;
                        pv_pass_bf16(rp, voff, n, pr, inv + g0, ng, d0, nc, orow);
                    }
                }
                continue;
            }
#endif
            for (int g0 = 0; g0 < G; g0 += 4) {
                const int ng = G - g0 < 4 ? G - g0 : 4;
                const int h0 = kh * G + g0;
                for (int d0 = 0; d0 < D; d0 += 64) {
                    const int nv = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
                    pv_pass(s, layer, row, kh, start, n, sc + h0 * pstride, pstride, inv + g0, ng, d0, nv,
                            (char *)out + esz * h0 * D, bf16);
                }
            }
        }
        return;
    }
#endif
    for (int kh = 0; kh < KVH; kh++)
        attend_scalar(s, layer, row, kh, start, n, q, sc, pstride, out, bf16);
}

static void run(const Step *s, int layer, int first, int count, const void *q, int64_t q_stride, void *out,
                int64_t out_stride, int bf16) {
    const int64_t esz = bf16 ? 2 : 4;
#pragma omp parallel
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)s->num_heads * ((size_t)s->max_ctx + TILE));
        const char **rp = (const char **)malloc(sizeof(char *) * ((size_t)s->max_ctx + TILE));
        uint16_t *pb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)s->num_heads * ((size_t)s->max_ctx + TILE));
        /* Last tokens first: in a prefill they have the longest contexts (better balance). */
#pragma omp for schedule(dynamic, 1)
        for (int i = count - 1; i >= 0; i--) {
            const int t = first + i;
            attend(s, layer, t, (const char *)q + esz * t * q_stride, (char *)out + esz * i * out_stride, sc, pb, rp, bf16);
        }
        free(pb);
        free(rp);
        free(sc);
    }
}

/* Attention for tokens [first, first + count) of the step; q row of token t at q + t * q_stride,
 * output row at out + (t - first) * out_stride (elements). */
void paged_attention(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q, int64_t q_stride,
                     void *out, int64_t out_stride) {
    if (s->num_heads / s->num_kv_heads > 64) abort(); /* inv[] bound; the Python side checks it */
    if (s->bf16) run(s, layer, first, count, q, q_stride, out, out_stride, 1);
    else run(s, layer, first, count, q, q_stride, out, out_stride, 0);
}
