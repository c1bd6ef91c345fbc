/*
 * Paged attention over an int8 pool (Step.kv_int8; `--kv-cache-dtype int8`, engine/kv_quant.py):
 * each row is head_dim int8 values and then its fp32 scale, so K_j = scale_j * k_j, V_j = scale_j *
 * v_j. The scales never multiply the rows: a score is scale * (q . k_j) * scale_j (one product per
 * key after the dot), and a weight p_j becomes p_j * scale_j before it meets v_j, so the rows are
 * only widened int8 -> fp32 in registers (a quarter of the fp32 pool's bytes read per key).
 *
 * Paths: AVX2 + FMA (any build that has it, AVX-512 ones included: the int8 rows are read 8
 * lanes at a time) for head_dim % 16 == 0, and the portable C. q and the output are in the
 * activation dtype (Step.bf16); the softmax and the sums are fp32 (bf16 steps round the weights to
 * bf16 for the V sum, as the float pool's AVX2 path and torch's SDPA do).
 *
 * Invariants: as paged_attention.c's (the step's K/V already stored by rope_store; scores never
 * read past a token's context); a row whose scale is 0 reads as zeros.
 * Included once, by paged_attention.c; static inline.
 */
#ifndef DUET_KERNELS_ATTENTION_INT8_H
#define DUET_KERNELS_ATTENTION_INT8_H

#include <omp.h>
#include <stdlib.h>

#include "attention_parts.h"

INLINE float row_scale(const int8_t *row, int D) {
    float f;
    __builtin_memcpy(&f, row + D, sizeof f);
    return f;
}

/* Portable path: kv head kh of one token, its G query heads. */
static void attend_i8_scalar(const Step *s, int layer, int row, int kh, int start, int n, const void *q, float *sc,
                             int64_t pstride, void *out, int bf16) {
    const int D = s->head_dim, G = s->num_heads / s->num_kv_heads;
    for (int g = 0; g < G; g++) {
        const int64_t qo = (int64_t)(kh * G + g) * D;
        float *p = sc + (int64_t)(kh * G + g) * pstride;
        RowIter it;
        rows_init(&it, s, layer, row, kh, 0, start);
        float m = -INFINITY;
        for (int j = 0; j < n; j++) {
            const int8_t *kp = (const int8_t *)rows_next(&it);
            float d = 0.f;
            for (int e = 0; e < D; e++) d += load_elem(q, qo + e, bf16) * (float)kp[e];
            p[j] = d * row_scale(kp, D) * s->scale;
            m = fmaxf(m, p[j]);
        }
        float sum = 0.f;
        for (int j = 0; j < n; j++) { p[j] = expf(p[j] - m); sum += p[j]; }
        float acc[256];
        for (int e0 = 0; e0 < D; e0 += 256) {
            const int ne = D - e0 < 256 ? D - e0 : 256;
            for (int e = 0; e < ne; e++) acc[e] = 0.f;
            rows_init(&it, s, layer, row, kh, 1, start);
            for (int j = 0; j < n; j++) {
                const int8_t *vp = (const int8_t *)rows_next(&it);
                const float w = p[j] * row_scale(vp, D);
                for (int e = 0; e < ne; e++) acc[e] += w * (float)vp[e0 + e];
            }
            for (int e = 0; e < ne; e++) store_elem(out, qo + e0 + e, acc[e] / sum, bf16);
        }
    }
}

#if defined(DUET_VEC8)
#define KT8 4 /* keys per score tile */
#define PF8 16 /* keys ahead whose K and V rows are prefetched */

/* 8 int8 values widened to fp32. */
INLINE __m256 i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* dst[g][0..KT8) = ks[i] * (q_g . k_i) for KT8 int8 key rows kp[i] and NG <= 3 query heads (fp32,
 * q_g at qf + g * D); ks[i] = the attention scale times key i's row scale. 12 accumulators: each
 * widened key serves three heads, each q load four keys. NG a constant (qk_i8). */
INLINE void qk_i8_k(const float *qf, const int8_t *const *kp, int D, const int NG, const float *ks, float *const *dst) {
    __m256 acc[3][KT8];
    for (int g = 0; g < 3; g++)
        for (int i = 0; i < KT8; i++) acc[g][i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 qv[3];
        for (int g = 0; g < NG; g++) qv[g] = _mm256_loadu_ps(qf + g * D + d);
        for (int i = 0; i < KT8; i++) {
            const __m256 k = i8x8(kp[i] + d);
            for (int g = 0; g < NG; g++) acc[g][i] = _mm256_fmadd_ps(qv[g], k, acc[g][i]);
        }
    }
    const __m128 vs = _mm_loadu_ps(ks);
    for (int g = 0; g < NG; g++) {
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
        const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
        _mm_storeu_ps(dst[g], _mm_mul_ps(sum, vs));
    }
}

static void qk_i8(const float *qf, const int8_t *const *kp, int D, int ng, const float *ks, float *const *dst) {
    if (ng == 3) qk_i8_k(qf, kp, D, 3, ks, dst);
    else if (ng == 2) qk_i8_k(qf, kp, D, 2, ks, dst);
    else qk_i8_k(qf, kp, D, 1, ks, dst);
}

/* out[g] dims [d0, d0 + 8 NV) = inv[g] * sum_j pr[g][j] scale_j v_j for NG <= 3 rows of weights, the
 * int8 V row of key j at rp[j] + voff (its scale D bytes on): 3 x 4 accumulators in registers. NG
 * and NV (2 or 4) constants (pv_i8). */
INLINE void pv_i8_k(const char *const *rp, int64_t voff, int n, int D, const float *const *pr, const float *inv,
                    const int NG, int d0, const int NV, void *const *orow, int bf16) {
    __m256 acc[3][4];
    for (int g = 0; g < 3; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        const int8_t *v = (const int8_t *)(rp[j] + voff);
        const float vs = row_scale(v, D);
        __m256 w[3];
        for (int g = 0; g < NG; g++) w[g] = _mm256_set1_ps(pr[g][j] * vs);
        for (int c = 0; c < NV; c++) {
            const __m256 a = i8x8(v + d0 + 8 * c);
            for (int g = 0; g < NG; g++) acc[g][c] = _mm256_fmadd_ps(w[g], a, acc[g][c]);
        }
    }
    for (int g = 0; g < NG; g++) {
        const __m256 sc = _mm256_set1_ps(inv[g]);
        for (int c = 0; c < NV; c++) store8(orow[g], d0 + 8 * c, _mm256_mul_ps(acc[g][c], sc), bf16);
    }
}

static void pv_i8(const char *const *rp, int64_t voff, int n, int D, const float *const *pr, const float *inv,
                  int ng, int d0, int nv, void *const *orow, int bf16) {
#define PVI8(NG, NV) pv_i8_k(rp, voff, n, D, pr, inv, NG, d0, NV, orow, bf16)
#define PVI8_NG(NV)                                                                                                 \
    switch (ng) {                                                                                                   \
    case 1: PVI8(1, NV); break;                                                                                     \
    case 2: PVI8(2, NV); break;                                                                                     \
    default: PVI8(3, NV); break;                                                                                    \
    }
    if (nv == 4) { PVI8_NG(4) } else { PVI8_NG(2) }
#undef PVI8_NG
#undef PVI8
}

/* kv heads [kh0, kh1) of one token (head_dim % 16 == 0): rows' addresses, scores KT8 keys x 3 heads
 * at a time (the tile PF8 keys ahead prefetched), the softmax, then the V sum 3 heads x 32 dims. */
static void attend_i8(const Step *s, int layer, int row, int start, int n, const void *q, void *out, float *sc,
                      float *qf, const char **rp, int bf16, int kh0, int kh1) {
    const int D = s->head_dim, G = s->num_heads / s->num_kv_heads, RW = D + 4;
    const int64_t pstride = (int64_t)s->max_ctx + TILE, v_bytes = (int64_t)s->block_size * s->num_kv_heads * RW;
    RowIter it;
    rows_init(&it, s, layer, row, 0, 0, start);
    for (int i = 0; i < n; i++) rp[i] = (const char *)rows_next(&it);
    for (int i = n; i < n + KT8; i++) rp[i] = rp[0]; /* padding keys, their scores never read */
    if (bf16) {
        for (int64_t e = (int64_t)kh0 * G * D; e < (int64_t)kh1 * G * D; e++) qf[e] = load_elem(q, e, 1);
    } else {
        qf = (float *)q;
    }
    const int64_t line0 = (int64_t)kh0 * RW / 64, line1 = ((int64_t)kh1 * RW + 63) / 64;
    for (int j = 0; j < n; j += KT8) {
        for (int r = j + PF8; r < j + PF8 + KT8 && r < n; r++)
            for (int64_t c = line0; c < line1; c++) {
                _mm_prefetch(rp[r] + 64 * c, _MM_HINT_T0);
                _mm_prefetch(rp[r] + v_bytes + 64 * c, _MM_HINT_T0);
            }
        for (int kh = kh0; kh < kh1; kh++) {
            const int8_t *kp[KT8];
            float ks[KT8];
            for (int i = 0; i < KT8; i++) {
                kp[i] = (const int8_t *)(rp[j + i] + (int64_t)kh * RW);
                ks[i] = s->scale * row_scale(kp[i], D);
            }
            for (int g0 = 0; g0 < G; g0 += 3) {
                const int ng = G - g0 < 3 ? G - g0 : 3, h0 = kh * G + g0;
                float *dst[3];
                for (int g = 0; g < ng; g++) dst[g] = sc + (h0 + g) * pstride + j;
                qk_i8(qf + (int64_t)h0 * D, kp, D, ng, ks, dst);
            }
        }
    }
    float inv[64];
    for (int kh = kh0; kh < kh1; kh++) {
        for (int g = 0; g < G; g++) inv[g] = softmax8(sc + (kh * G + g) * pstride, n, bf16);
        const int64_t voff = v_bytes + (int64_t)kh * RW;
        for (int g0 = 0; g0 < G; g0 += 3) {
            const int ng = G - g0 < 3 ? G - g0 : 3, h0 = kh * G + g0;
            const float *pr[3];
            void *orow[3];
            for (int g = 0; g < ng; g++) {
                pr[g] = sc + (h0 + g) * pstride;
                orow[g] = (char *)out + (bf16 ? 2 : 4) * (int64_t)(h0 + g) * D;
            }
            for (int d0 = 0; d0 < D; d0 += 32) pv_i8(rp, voff, n, D, pr, inv + g0, ng, d0, D - d0 < 32 ? 2 : 4, orow, bf16);
        }
    }
}
#endif

/* Tokens [first, first + count) over an int8 pool; work items (token, kv head) when the step has
 * fewer tokens than threads (a single stream's heads spread over the cores), else whole tokens. */
static void paged_attention_i8(const Step *s, int layer, int first, int count, const void *q, int64_t q_stride,
                               void *out, int64_t out_stride) {
    const int bf16 = s->bf16, KVH = s->num_kv_heads, split = count < omp_get_max_threads() ? KVH : 1;
    const int64_t esz = bf16 ? 2 : 4, items = (int64_t)count * split, pstride = (int64_t)s->max_ctx + TILE;
#pragma omp parallel
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)s->num_heads * (size_t)pstride);
        const char **rp = (const char **)malloc(sizeof(char *) * (size_t)pstride);
        float *qf = (float *)malloc(sizeof(float) * (size_t)s->num_heads * (size_t)s->head_dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = items - 1; i >= 0; i--) {
            const int t = first + (int)(i / split), part = (int)(i % split);
            const int ctx = s->ctx_lens[t], kh0 = part * KVH / split, kh1 = (part + 1) * KVH / split;
            const int start = (s->window > 0 && ctx > s->window) ? ctx - s->window : 0;
            const void *qt = (const char *)q + esz * t * q_stride;
            void *ot = (char *)out + esz * (t - first) * out_stride;
#if defined(DUET_VEC8)
            if ((s->head_dim & 15) == 0) {
                attend_i8(s, layer, s->token_row[t], start, ctx - start, qt, ot, sc, qf, rp, bf16, kh0, kh1);
                continue;
            }
#endif
            for (int kh = kh0; kh < kh1; kh++)
                attend_i8_scalar(s, layer, s->token_row[t], kh, start, ctx - start, qt, sc, pstride, ot, bf16);
        }
        free(qf);
        free(rp);
        free(sc);
    }
}

#endif
