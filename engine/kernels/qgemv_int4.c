/*
 * int4 weight-only linear: w = d * q + m per group of 32 or 64 weights along k (fp16 d and m,
 * q in 0..15), packed in 64-weight super-blocks of 16 uint16 lanes, lane i holding weights
 * i, 16+i, 32+i, 48+i in its four nibbles (engine/quant.py). Activations bf16 or fp32, fp32
 * accumulation; k must be a multiple of 64.
 *
 * Decode (m == 1): one 32-byte load widens to 16 int32 lanes; each nibble (a shift away) indexes
 * a 16-entry fp32 table fma(d, [0..15], m) held in one register (vpermps reads the low 4 bits),
 * so a weight costs a shift and a permute per 16, and the table is exactly the dequantized value
 * (one rounding of d * q + m, as engine/quant.py defines it). Batched calls dequantize 16 rows
 * into a cached fp32 tile. Batches of bf16 activations large enough to amortize it take the bf16
 * GEMM path instead (qgemm_bf16.h: the same fma(d, q, m), rounded to bf16).
 */
#include "qgemm.h"
#include "qgemm_bf16.h"

typedef struct {
    const uint8_t *q;     /* [n][k / 2] */
    const uint16_t *d;    /* fp16 [n][k / group] */
    const uint16_t *mins; /* fp16 [n][k / group] */
    int64_t k;
    int group;
} Int4W;

INLINE float half_to_f32(uint16_t h) {
    const uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, f = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (e == 0x1f) v.u = s | 0x7f800000u | (f << 13);
    else if (e) v.u = s | ((e + 112) << 23) | (f << 13);
    else { v.f = (float)f * 5.9604644775390625e-8f; v.u |= s; } /* subnormal: f * 2^-24 */
    return v.f;
}

#if defined(__AVX512F__)
/* d, m of groups [0, ng) of one row, as fp32. */
INLINE void row_scales(const uint16_t *d16, const uint16_t *m16, int64_t ng, float *d, float *m) {
    int64_t g = 0;
    for (; g + 16 <= ng; g += 16) {
        _mm512_storeu_ps(d + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d16 + g))));
        _mm512_storeu_ps(m + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m16 + g))));
    }
    for (; g < ng; g++) { d[g] = half_to_f32(d16[g]); m[g] = half_to_f32(m16[g]); }
}
#endif

__attribute__((unused)) static void dequant_int4_scalar(const void *ctx, int64_t n0, int nr, float *tile, int64_t kp) {
    const Int4W *w = (const Int4W *)ctx;
    const int64_t k = w->k, ng = k / w->group;
    for (int r = 0; r < nr; r++) {
        const uint8_t *src = w->q + (n0 + r) * (k / 2);
        float *dst = tile + (int64_t)r * kp;
        for (int64_t s = 0; s < k / 64; s++) {
            for (int i = 0; i < 16; i++) {
                const uint32_t lane = (uint32_t)src[32 * s + 2 * i] | ((uint32_t)src[32 * s + 2 * i + 1] << 8);
                for (int j = 0; j < 4; j++) {
                    const int64_t idx = 64 * s + 16 * j + i, g = idx / w->group;
                    const float d = half_to_f32(w->d[(n0 + r) * ng + g]), m = half_to_f32(w->mins[(n0 + r) * ng + g]);
                    dst[idx] = fmaf(d, (float)((lane >> (4 * j)) & 0xF), m);
                }
            }
        }
        for (int64_t i = k; i < kp; i++) dst[i] = 0.f;
    }
}


/* Rows n0..n0+nr of W as fp32 into tile [nr][kp] (the m > 1 path; same values as the tables). */
static void dequant_int4(const void *ctx, int64_t n0, int nr, float *tile, int64_t kp) {
#if defined(__AVX512F__)
    const Int4W *w = (const Int4W *)ctx;
    const int64_t k = w->k, ng = k / w->group;
    const int g32 = w->group == 32;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float *d = (float *)malloc(sizeof(float) * 2 * ng), *m = d + ng;
    for (int r = 0; r < nr; r++) {
        const uint8_t *src = w->q + (n0 + r) * (k / 2);
        float *dst = tile + (int64_t)r * kp;
        row_scales(w->d + (n0 + r) * ng, w->mins + (n0 + r) * ng, ng, d, m);
        for (int64_t s = 0; s < k / 64; s++) {
            const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 32 * s)));
            const int64_t g0 = g32 ? 2 * s : s, g1 = g32 ? 2 * s + 1 : s;
            const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[g0]), _mm512_set1_ps(m[g0]));
            const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[g1]), _mm512_set1_ps(m[g1]));
            _mm512_storeu_ps(dst + 64 * s, _mm512_permutexvar_ps(v, t0));
            _mm512_storeu_ps(dst + 64 * s + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t0));
            _mm512_storeu_ps(dst + 64 * s + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), t1));
            _mm512_storeu_ps(dst + 64 * s + 48, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), t1));
        }
        for (int64_t i = k; i < kp; i++) dst[i] = 0.f;
    }
    free(d);
#else
    dequant_int4_scalar(ctx, n0, nr, tile, kp);
#endif
}

static void gemv_int4(const float *x, const Int4W *w, int64_t n, const void *bias, void *out, int bf16) {
    const int64_t k = w->k, ng = k / w->group, blocks = (n + QG_NB - 1) / QG_NB;
    const int g32 = w->group == 32;
#pragma omp parallel if (n * k >= (1 << 15))
    {
#if defined(__AVX512F__)
        float *dm = (float *)malloc(sizeof(float) * 2 * QG_NB * ng);
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * QG_NB;
            const int nr = (int)(n - n0 < QG_NB ? n - n0 : QG_NB);
#if defined(__AVX512F__)
            const uint8_t *rows[QG_NB];
            const float *dr[QG_NB], *mr[QG_NB];
            for (int r = 0; r < QG_NB; r++) {
                const int64_t row = n0 + (r < nr ? r : nr - 1);
                rows[r] = w->q + row * (k / 2);
                dr[r] = dm + 2 * r * ng;
                mr[r] = dr[r] + ng;
                if (r < nr) row_scales(w->d + row * ng, w->mins + row * ng, ng, dm + 2 * r * ng, dm + 2 * r * ng + ng);
            }
            __m512 acc[QG_NB];
            /* 4 rows at a time: their accumulators stay in registers and 4 independent FMA
             * chains hide the FMA latency; x (one row, fp32) is re-read from L1. */
            for (int r0 = 0; r0 < QG_NB; r0 += 4) {
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                /* the rows 8 on follow these in memory: fetch them two lines per super-block,
                 * so the weight stream stays ahead of its use (rows are too short for the
                 * hardware prefetcher to ramp up); 8 rows ahead rather than the next 4: 8.5 -> 9.0
                 * GB/s over SmolLM2's int4 matrices at 2 threads (4, 8, 16 rows tried) */
                const char *next = (const char *)rows[r0] + 4 * k;
                for (int64_t s = 0; s < k / 64; s++) {
                    _mm_prefetch(next + 128 * s, _MM_HINT_T0);
                    _mm_prefetch(next + 128 * s + 64, _MM_HINT_T0);
                    const __m512 x0 = _mm512_loadu_ps(x + 64 * s), x1 = _mm512_loadu_ps(x + 64 * s + 16);
                    const __m512 x2 = _mm512_loadu_ps(x + 64 * s + 32), x3 = _mm512_loadu_ps(x + 64 * s + 48);
                    const int64_t g0 = g32 ? 2 * s : s, g1 = g32 ? 2 * s + 1 : s;
#define DUET_INT4_ROW(a, r)                                                                                   \
    do {                                                                                                      \
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(rows[r] + 32 * s)));    \
        const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dr[r][g0]), _mm512_set1_ps(mr[r][g0]));     \
        const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dr[r][g1]), _mm512_set1_ps(mr[r][g1]));     \
        a = _mm512_fmadd_ps(x0, _mm512_permutexvar_ps(v, t0), a);                                            \
        a = _mm512_fmadd_ps(x1, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t0), a);                      \
        a = _mm512_fmadd_ps(x2, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), t1), a);                      \
        a = _mm512_fmadd_ps(x3, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), t1), a);                     \
    } while (0)
                    DUET_INT4_ROW(a0, r0);
                    DUET_INT4_ROW(a1, r0 + 1);
                    DUET_INT4_ROW(a2, r0 + 2);
                    DUET_INT4_ROW(a3, r0 + 3);
#undef DUET_INT4_ROW
                }
                acc[r0] = a0, acc[r0 + 1] = a1, acc[r0 + 2] = a2, acc[r0 + 3] = a3;
            }
            qg_finish16(acc, nr, out, 0, n0, NULL, bias, bf16);
#else
            float tile[64];
            for (int r = 0; r < nr; r++) {
                float acc = 0.f;
                for (int64_t s = 0; s < k / 64; s++) {
                    /* one super-block at a time through the same dequantization as the tile path */
                    Int4W one = *w;
                    one.q = w->q + (n0 + r) * (k / 2) + 32 * s;
                    one.d = w->d + (n0 + r) * ng + s * 64 / w->group;
                    one.mins = w->mins + (n0 + r) * ng + s * 64 / w->group;
                    one.k = 64;
                    dequant_int4_scalar(&one, 0, 1, tile, 64);
                    for (int i = 0; i < 64; i++) acc += x[64 * s + i] * tile[i];
                }
                qg_store(out, n0 + r, acc, n0 + r, NULL, bias, bf16);
            }
#endif
        }
#if defined(__AVX512F__)
        free(dm);
#endif
    }
}

/* out [m][os] = x [m][xs] @ W^T + bias, W int4 as above; x bf16 (bf16 != 0) or fp32; out and bias
 * in x's dtype, or fp32 with out_f32. Returns 0, -1 when out of memory, -2 when k is not a
 * multiple of 64 or group not 32/64. */
int32_t qlinear_int4(const void *x, int64_t xs, int32_t m, int32_t k, const uint8_t *q, const uint16_t *d,
                     const uint16_t *mins, int32_t group, int64_t n, const void *bias, void *out, int64_t os,
                     int32_t bf16, int32_t out_f32) {
    if (k % 64 || (group != 32 && group != 64)) return -2;
    float *X = qg_x_f32(x, xs, m, k, bf16);
    if (!X) return -1;
    bf16 = bf16 && !out_f32;
    const Int4W w = {q, d, mins, k, group};
    if (m == 1) gemv_int4(X, &w, n, bias, out, bf16);
    else qg_gemm(X, m, k, n, &w, dequant_int4, out, os, NULL, bias, bf16);
    free(X);
    return 0;
}

#if defined(QB_BF16)
/* Rows n0 .. n0 + nr of W as bf16 (fma(d, q, m) rounded to nearest even) into the panel, one
 * 64-weight super-block (two 32-k chunks) at a time, each chunk one 16x16 transpose. */
static void dequant_int4_bf16(const void *ctx, int64_t n0, int nr, uint32_t *panel, int64_t kp) {
    const Int4W *w = (const Int4W *)ctx;
    const int64_t k = w->k, ng = k / w->group;
    const int g32 = w->group == 32;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float dm[2 * 16 * 64]; /* d, m of 16 rows; ng <= 64 here, else on the heap */
    float *d = ng <= 64 ? dm : (float *)malloc(sizeof(float) * 2 * 16 * ng);
    if (!d) return; /* unreachable in practice; the caller sees zeros */
    for (int i = 0; i < nr; i++)
        row_scales(w->d + (n0 + i) * ng, w->mins + (n0 + i) * ng, ng, d + 2 * i * ng, d + 2 * i * ng + ng);
    for (int64_t s = 0; s < k / 64; s++) {
        __m512i r0[16], r1[16];
        const int64_t g0 = g32 ? 2 * s : s, g1 = g32 ? 2 * s + 1 : s;
        for (int i = 0; i < 16; i++) {
            if (i >= nr) {
                r0[i] = r1[i] = _mm512_setzero_si512();
                continue;
            }
            const float *di = d + 2 * i * ng, *mi = di + ng;
            const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w->q + (n0 + i) * (k / 2) + 32 * s)));
            const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(di[g0]), _mm512_set1_ps(mi[g0]));
            const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(di[g1]), _mm512_set1_ps(mi[g1]));
            r0[i] = qb_pairs(_mm512_permutexvar_ps(v, t0), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t0));
            r1[i] = qb_pairs(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), t1),
                             _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), t1));
        }
        transpose16(r0);
        transpose16(r1);
        for (int p = 0; p < 16; p++) {
            _mm512_store_si512((void *)(panel + (32 * s + p) * 16), r0[p]);
            _mm512_store_si512((void *)(panel + (32 * s + 16 + p) * 16), r1[p]);
        }
    }
    if (d != dm) free(d);
    (void)kp;
}
#endif

/* qlinear_int4 for bf16 x on the bf16 GEMM path (see qlinear_int8_bf16). Returns 0, -1 when out
 * of memory, -2 for a bad shape, -3 when the path is not available. */
int32_t qlinear_int4_bf16(const uint16_t *x, int64_t xs, int32_t m, int32_t k, const uint8_t *q, const uint16_t *d,
                          const uint16_t *mins, int32_t group, int64_t n, const uint16_t *bias, void *out, int64_t os,
                          int32_t out_f32, int32_t isa) {
    if (k % 64 || (group != 32 && group != 64)) return -2;
    const int have = qb_isa();
    if (isa == 0) isa = have;
    if (isa < 1 || isa > have) return -3;
#if defined(QB_BF16)
    const Int4W w = {q, d, mins, k, group};
    return qb_gemm(x, xs, m, k, n, &w, dequant_int4_bf16, NULL, bias, out, os, out_f32, isa);
#else
    (void)x, (void)xs, (void)m, (void)q, (void)d, (void)mins, (void)n, (void)bias, (void)out, (void)os, (void)out_f32;
    return -3;
#endif
}
