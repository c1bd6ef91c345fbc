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
 * past a token's context; results equal softmax(q.K^T * scale).V up to fp32 rounding, and in
 * bf16 up to the rounding of the weights to bf16 (the AVX-512 BF16 and AVX2 paths, as torch's
 * bf16 SDPA rounds them).
 * An int8 pool (Step.kv_int8) is read by attention_int8.h's paths.
 * Threads: OpenMP, resolved against the libgomp torch already loaded (one thread pool).
 */
#include <omp.h>
#include <stdlib.h>

#include "attention_int8.h"
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

#if defined(DUET_AVX2)
#define KT 4 /* keys per AVX2 score tile */
#define PF_KEYS 16 /* keys ahead whose K and V rows the AVX2 path prefetches */

/* dst[g][0..KT) = scale * q_g . k_i for the KT keys kp[i] and ng <= 3 query heads, q_g (fp32) at
 * qf + g * D; bf16 keys are widened in pairs (vec8_load_pairs), so a bf16 q is stored split the
 * same way (even elements of each 16, then the odd ones). 12 accumulators: each key load serves
 * three heads, each q load four keys. */
INLINE void qk_tile4_k(const float *qf, const char *const *kp, int D, const int ng, float scale, float *const *dst,
                       const int bf16) {
    __m256 acc[3][KT];
    for (int g = 0; g < 3; g++)
        for (int i = 0; i < KT; i++) acc[g][i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        /* bf16: d = 16 c + 8 h is half h (even elements, then odd) of the pairs of [16 c, 16 c + 16) */
        const int half = d & 8;
        __m256 qv[3];
        for (int g = 0; g < ng; g++) qv[g] = _mm256_loadu_ps(qf + g * D + d);
        for (int i = 0; i < KT; i++) {
            __m256 k;
            if (bf16) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)kp[i] + d - half));
                k = _mm256_castsi256_ps(half ? _mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000u))
                                             : _mm256_slli_epi32(raw, 16));
            } else {
                k = _mm256_loadu_ps((const float *)kp[i] + d);
            }
            for (int g = 0; g < ng; g++) acc[g][i] = _mm256_fmadd_ps(qv[g], k, acc[g][i]);
        }
    }
    const __m128 vs = _mm_set1_ps(scale);
    for (int g = 0; g < ng; g++) {
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
        const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
        _mm_storeu_ps(dst[g], _mm_mul_ps(sum, vs));
    }
}

/* qk_tile4_k with ng and bf16 constants (tested in the loop, they spilled the accumulators). */
INLINE void qk_tile4(const float *qf, const char *const *kp, int D, int ng, float scale, float *const *dst, const int bf16) {
    if (ng == 3) qk_tile4_k(qf, kp, D, 3, scale, dst, bf16);
    else if (ng == 2) qk_tile4_k(qf, kp, D, 2, scale, dst, bf16);
    else qk_tile4_k(qf, kp, D, 1, scale, dst, bf16);
}

/* attend's AVX2 path (head_dim % 16 == 0): rows' addresses, scores KT keys x 3 heads at a time
 * (the tile PF_KEYS ahead prefetched), the softmax, then the V sum 3 heads x 32 dims a pass. */
INLINE void attend8(const Step *s, int layer, int row, int start, int n, const void *q, void *out, float *sc,
                    float *qf, const char **rp, int bf16, int kh0, int kh1) {
    const int D = s->head_dim, KVH = s->num_kv_heads, G = s->num_heads / s->num_kv_heads;
    const int64_t pstride = (int64_t)s->max_ctx + TILE, esz = bf16 ? 2 : 4;
    const int64_t row_bytes = esz * KVH * D, v_bytes = esz * s->block_size * KVH * D;
    RowIter it;
    rows_init(&it, s, layer, row, 0, 0, start);
    for (int i = 0; i < n; i++) rp[i] = (const char *)rows_next(&it);
    for (int i = n; i < n + KT; i++) rp[i] = rp[0]; /* padding keys, their scores never read */
    if (bf16) {
        for (int64_t e = (int64_t)kh0 * G * D; e < (int64_t)kh1 * G * D; e += 16) {
            __m256 a, b;
            vec8_load_pairs((const uint16_t *)q + e, &a, &b);
            _mm256_storeu_ps(qf + e, a);
            _mm256_storeu_ps(qf + e + 8, b);
        }
    } else {
        qf = (float *)q;
    }
    /* the lines of the row slices of kv heads [kh0, kh1) */
    const int64_t line0 = esz * kh0 * D / 64, line1 = (esz * kh1 * D + 63) / 64;
    (void)row_bytes;
    for (int j = 0; j < n; j += KT) {
        for (int r = j + PF_KEYS; r < j + PF_KEYS + KT && r < n; r++)
            for (int64_t c = line0; c < line1; c++) {
                _mm_prefetch(rp[r] + 64 * c, _MM_HINT_T0);
                _mm_prefetch(rp[r] + v_bytes + 64 * c, _MM_HINT_T0);
            }
        for (int kh = kh0; kh < kh1; kh++) {
            const char *kp[KT];
            for (int i = 0; i < KT; i++) kp[i] = rp[j + i] + esz * kh * D;
            for (int g0 = 0; g0 < G; g0 += 3) {
                const int ng = G - g0 < 3 ? G - g0 : 3, h0 = kh * G + g0;
                float *dst[3];
                for (int g = 0; g < ng; g++) dst[g] = sc + (h0 + g) * pstride + j;
                qk_tile4(qf + (int64_t)h0 * D, kp, D, ng, s->scale, dst, bf16);
            }
        }
    }
    float inv[64];
    for (int kh = kh0; kh < kh1; kh++) {
        for (int g = 0; g < G; g++) inv[g] = softmax8(sc + (kh * G + g) * pstride, n, bf16);
        const int64_t voff = v_bytes + esz * kh * D;
        for (int g0 = 0; g0 < G; g0 += 3) {
            const int ng = G - g0 < 3 ? G - g0 : 3, h0 = kh * G + g0;
            const float *pr[3];
            void *orow[3];
            for (int g = 0; g < ng; g++) {
                pr[g] = sc + (h0 + g) * pstride;
                orow[g] = (char *)out + esz * (h0 + g) * D;
            }
            for (int d0 = 0; d0 < D; d0 += 32) pv_pass8(rp, voff, n, pr, 1, inv + g0, ng, d0, D - d0 < 32 ? 2 : 4, orow, bf16);
        }
    }
}
#endif

/* Portable path (no AVX-512 or AVX2, or head_dim not a multiple of 16). */
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
INLINE void attend(const Step *s, int layer, int t, const void *q, void *out, float *sc, uint16_t *pb, float *qf,
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
#elif defined(DUET_AVX2)
    if ((D & 15) == 0) {
        attend8(s, layer, row, start, n, q, out, sc, qf, rp, bf16, 0, KVH);
        return;
    }
#endif
    (void)qf;
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
        float *qf = (float *)malloc(sizeof(float) * (size_t)s->num_heads * (size_t)s->head_dim);
        /* Last tokens first: in a prefill they have the longest contexts (better balance). */
#pragma omp for schedule(dynamic, 1)
        for (int i = count - 1; i >= 0; i--) {
            const int t = first + i;
            attend(s, layer, t, (const char *)q + esz * t * q_stride, (char *)out + esz * i * out_stride, sc, pb, qf, rp, bf16);
        }
        free(qf);
        free(pb);
        free(rp);
        free(sc);
    }
}

#if defined(DUET_AVX2)
/* The AVX2 path's work items: (token, kv head) when the step has fewer tokens than threads (a
 * single-stream decode's heads spread over the cores; each head's result is the same whatever
 * the grouping), else whole tokens. */
static void run8(const Step *s, int layer, int first, int count, const void *q, int64_t q_stride, void *out,
                 int64_t out_stride, int bf16) {
    const int64_t esz = bf16 ? 2 : 4;
    const int KVH = s->num_kv_heads, split = count < omp_get_max_threads() ? KVH : 1;
    const int64_t items = (int64_t)count * split;
#pragma omp parallel
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)s->num_heads * ((size_t)s->max_ctx + TILE));
        const char **rp = (const char **)malloc(sizeof(char *) * ((size_t)s->max_ctx + TILE));
        float *qf = (float *)malloc(sizeof(float) * (size_t)s->num_heads * (size_t)s->head_dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = items - 1; i >= 0; i--) {
            const int t = first + (int)(i / split), part = (int)(i % split);
            const int ctx = s->ctx_lens[t];
            const int start = (s->window > 0 && ctx > s->window) ? ctx - s->window : 0;
            attend8(s, layer, s->token_row[t], start, ctx - start, (const char *)q + esz * t * q_stride,
                    (char *)out + esz * (t - first) * out_stride, sc, qf, rp, bf16, part * KVH / split,
                    (part + 1) * KVH / split);
        }
        free(qf);
        free(rp);
        free(sc);
    }
}
#endif

/* Attention for tokens [first, first + count) of the step; q row of token t at q + t * q_stride,
 * output row at out + (t - first) * out_stride (elements). */
void paged_attention(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q, int64_t q_stride,
                     void *out, int64_t out_stride) {
    if (s->num_heads / s->num_kv_heads > 64) abort(); /* inv[] bound; the Python side checks it */
    if (s->kv_int8) {
        paged_attention_i8(s, layer, first, count, q, q_stride, out, out_stride);
        return;
    }
#if defined(DUET_AVX2)
    if ((s->head_dim & 15) == 0) {
        if (s->bf16) run8(s, layer, first, count, q, q_stride, out, out_stride, 1);
        else run8(s, layer, first, count, q, q_stride, out, out_stride, 0);
        return;
    }
#endif
    if (s->bf16) run(s, layer, first, count, q, q_stride, out, out_stride, 1);
    else run(s, layer, first, count, q, q_stride, out, out_stride, 0);
}
