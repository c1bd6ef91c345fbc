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
 *
 * Where the CPU has AVX-512 BF16, bf16 activations (every m below the bf16 GEMM's) take the
 * vdpbf16ps path instead (int4_dp below: the group scales factored out of the dot, 8 vector
 * operations per row and 64 weights against these 14); fp32 activations keep the tables.
 */
#include "qgemm.h"
#include "qgemm_bf16.h"

typedef struct {
    const uint8_t *q;     /* [n][k / 2] */
    const uint16_t *d;    /* fp16 [n][k / group] */
    const uint16_t *mins; /* fp16 [n][k / group] */
    int64_t k;
    int group;
    int64_t n; /* rows: the bf16 dequant prefetches the next block's rows while they exist */
} Int4W;

INLINE float half_to_f32(uint16_t h) {
    const uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, f = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (e == 0x1f) v.u = s | 0x7f800000u | (f << 13);
    else if (e) v.u = s | ((e + 112) << 23) | (f << 13);
    else { v.f = (float)f * 5.9604644775390625e-8f; v.u |= s; } /* subnormal: f * 2^-24 */
    return v.f;
}

#if defined(DUET_AVX2)
/* ng fp16 scales of one row as fp32 (F16C, as AVX-512's vcvtph2ps converts them). */
INLINE void row_f32(const uint16_t *src, int64_t ng, float *dst) {
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8)
        _mm256_storeu_ps(dst + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + g))));
    for (; g < ng; g++) dst[g] = _cvtsh_ss(src[g]);
}

/* Eight weights of a super-block, nibble j of lanes v (8 uint16 lanes widened), dequantized as
 * fma(q, d, m): the AVX-512 path's table entry q, the same rounding. */
INLINE __m256 i4_w8(__m256i v, const int j, __m256 d, __m256 m) {
    __m256i q = j ? _mm256_srli_epi32(v, 4 * j) : v;
    if (j < 3) q = _mm256_and_si256(q, _mm256_set1_epi32(15));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
}

/* A super-block's 16 lanes of a packed row, widened: lanes 0-7 and 8-15. */
INLINE void i4_lanes(const uint8_t *sb, __m256i *lo, __m256i *hi) {
    *lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)sb));
    *hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(sb + 16)));
}
#endif

#if defined(__AVX512F__)
/* ng fp16 scales of one row as fp32. */
INLINE void row_f32(const uint16_t *src, int64_t ng, float *dst) {
    int64_t g = 0;
    for (; g + 16 <= ng; g += 16)
        _mm512_storeu_ps(dst + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + g))));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* the tail masked (SmolLM2's k = 576 leaves 2 of 18 groups; half_to_f32 on them, for every
     * row of every such matrix, was a measurable share of the one-row kernel) */
    if (g < ng) {
        const __mmask16 mk = (__mmask16)((1u << (ng - g)) - 1);
        _mm512_mask_storeu_ps(dst + g, mk, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, src + g)));
    }
#else
    for (; g < ng; g++) dst[g] = half_to_f32(src[g]);
#endif
}
#endif

#if defined(__AVX512F__) || defined(DUET_AVX2)
/* A block of QG_NB weight rows from n0 (nr of them real; the rest repeat row n0 + nr - 1, computed
 * and not stored): each row's packed bytes, and its d as fp32 in dm [QG_NB][2][ng]; its m as fp32
 * in dm's second half (mr != NULL), or (m16 != NULL) a pointer to its fp16 m, which the
 * vdpbf16ps path reads once per row, in its finish: converting m into dm there and reading it
 * back cost the one-row kernel ~7 % (A/B over SmolLM2's 120 int4 matrices). */
INLINE void block_rows_int4(const Int4W *w, int64_t n0, int nr, float *dm, const uint8_t **rows, const float **dr,
                            const float **mr, const uint16_t **m16) {
    const int64_t k = w->k, ng = k / w->group;
    for (int r = 0; r < QG_NB; r++) {
        const int rr = r < nr ? r : nr - 1;
        const int64_t row = n0 + rr;
        rows[r] = w->q + row * (k / 2);
        dr[r] = dm + 2 * rr * ng;
        if (mr) mr[r] = dr[r] + ng;
        if (m16) m16[r] = w->mins + row * ng;
        if (r < nr) {
            row_f32(w->d + row * ng, ng, dm + 2 * r * ng);
            if (mr) row_f32(w->mins + row * ng, ng, dm + 2 * r * ng + ng);
        }
    }
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
        row_f32(w->d + (n0 + r) * ng, ng, d);
        row_f32(w->mins + (n0 + r) * ng, ng, m);
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
#elif defined(DUET_AVX2)
    const Int4W *w = (const Int4W *)ctx;
    const int64_t k = w->k, ng = k / w->group;
    const int g32 = w->group == 32;
    float *d = (float *)malloc(sizeof(float) * 2 * ng), *m = d + ng;
    for (int r = 0; r < nr; r++) {
        const uint8_t *src = w->q + (n0 + r) * (k / 2);
        float *dst = tile + (int64_t)r * kp;
        row_f32(w->d + (n0 + r) * ng, ng, d);
        row_f32(w->mins + (n0 + r) * ng, ng, m);
        for (int64_t s = 0; s < k / 64; s++) {
            __m256i lo, hi;
            i4_lanes(src + 32 * s, &lo, &hi);
            const int64_t g0 = g32 ? 2 * s : s, g1 = g32 ? 2 * s + 1 : s;
            const __m256 d0 = _mm256_set1_ps(d[g0]), m0 = _mm256_set1_ps(m[g0]);
            const __m256 d1 = _mm256_set1_ps(d[g1]), m1 = _mm256_set1_ps(m[g1]);
            float *o = dst + 64 * s;
            _mm256_storeu_ps(o, i4_w8(lo, 0, d0, m0));
            _mm256_storeu_ps(o + 8, i4_w8(hi, 0, d0, m0));
            _mm256_storeu_ps(o + 16, i4_w8(lo, 1, d0, m0));
            _mm256_storeu_ps(o + 24, i4_w8(hi, 1, d0, m0));
            _mm256_storeu_ps(o + 32, i4_w8(lo, 2, d1, m1));
            _mm256_storeu_ps(o + 40, i4_w8(hi, 2, d1, m1));
            _mm256_storeu_ps(o + 48, i4_w8(lo, 3, d1, m1));
            _mm256_storeu_ps(o + 56, i4_w8(hi, 3, d1, m1));
        }
        for (int64_t i = k; i < kp; i++) dst[i] = 0.f;
    }
    free(d);
#else
    dequant_int4_scalar(ctx, n0, nr, tile, kp);
#endif
}

#if defined(DUET_AVX2)
/* Rows n0 .. n0 + nr of W as qgemm_f32.h's fp32 panel (exact: fma(q, d, m), the GEMV's values),
 * 8 rows x 8 weights at a time. */
static void panel_int4(const void *ctx, int64_t n0, int nr, float *panel, int64_t kp) {
    const Int4W *w = (const Int4W *)ctx;
    const int64_t k = w->k, ng = k / w->group;
    const int g32 = w->group == 32;
    float dm[2][16][64]; /* d, m of 16 rows (ng <= 64), else on the heap */
    float *dd = ng <= 64 ? &dm[0][0][0] : (float *)malloc(sizeof(float) * 2 * 16 * (size_t)ng);
    if (!dd) return; /* unreachable in practice; the caller sees zeros */
    const int64_t dst = ng <= 64 ? 64 : ng; /* row stride of dd's tables */
    float *mm = dd + 16 * dst;
    for (int i = 0; i < nr; i++) {
        row_f32(w->d + (n0 + i) * ng, ng, dd + i * dst);
        row_f32(w->mins + (n0 + i) * ng, ng, mm + i * dst);
    }
    for (int c0 = 0; c0 < 16; c0 += 8)
        for (int64_t s = 0; s < k / 64; s++) {
            const int64_t g0 = g32 ? 2 * s : s, g1 = g32 ? 2 * s + 1 : s;
            for (int j = 0; j < 4; j++)
                for (int h = 0; h < 2; h++) {
                    __m256 r[8];
                    for (int i = 0; i < 8; i++) {
                        const int row = c0 + i;
                        if (row >= nr) {
                            r[i] = _mm256_setzero_ps();
                            continue;
                        }
                        const uint8_t *sb = w->q + (n0 + row) * (k / 2) + 32 * s;
                        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(sb + 16 * h)));
                        const int64_t g = j < 2 ? g0 : g1;
                        const __m256 d = _mm256_set1_ps(dd[row * dst + g]), m = _mm256_set1_ps(mm[row * dst + g]);
                        switch (j) { /* the nibble a constant (i4_w8 folds its shift and mask) */
                        case 0: r[i] = i4_w8(v, 0, d, m); break;
                        case 1: r[i] = i4_w8(v, 1, d, m); break;
                        case 2: r[i] = i4_w8(v, 2, d, m); break;
                        default: r[i] = i4_w8(v, 3, d, m); break;
                        }
                    }
                    qf_put8x8(r, panel, 64 * s + 16 * j + 8 * h, c0);
                }
        }
    for (int64_t j0 = k; j0 < kp; j0++) memset(panel + 16 * j0, 0, 64); /* inputs past k */
    if (dd != &dm[0][0][0]) free(dd);
}
#endif

static void gemv_int4(const float *x, const Int4W *w, int64_t n, const void *bias, void *out, int bf16) {
    const int64_t k = w->k, ng = k / w->group, blocks = (n + QG_NB - 1) / QG_NB;
    const int g32 = w->group == 32;
#pragma omp parallel if (n * k >= (1 << 15))
    {
#if defined(DUET_AVX2)
        float *dm = (float *)malloc(sizeof(float) * 2 * QG_NB * ng);
#endif
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
            block_rows_int4(w, n0, nr, dm, rows, dr, mr, NULL);
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
#elif defined(DUET_AVX2)
            const uint8_t *rows[QG_NB];
            const float *dr[QG_NB], *mr[QG_NB];
            block_rows_int4(w, n0, nr, dm, rows, dr, mr, NULL);
            __m256 lo[QG_NB], hi[QG_NB];
            /* the AVX-512 loop's chains as halves: 4 rows at a time, each super-block's four chunks
             * in order into lane l of its row's accumulator, prefetching 8 rows ahead */
            for (int r0 = 0; r0 < QG_NB; r0 += 4) {
                __m256 al[4], ah[4];
                for (int r = 0; r < 4; r++) al[r] = ah[r] = _mm256_setzero_ps();
                const char *next = (const char *)rows[r0] + 4 * k;
                for (int64_t s = 0; s < k / 64; s++) {
                    _mm_prefetch(next + 128 * s, _MM_HINT_T0);
                    _mm_prefetch(next + 128 * s + 64, _MM_HINT_T0);
                    const float *xs = x + 64 * s;
                    const int64_t g0 = g32 ? 2 * s : s, g1 = g32 ? 2 * s + 1 : s;
                    for (int r = 0; r < 4; r++) {
                        __m256i vl, vh;
                        i4_lanes(rows[r0 + r] + 32 * s, &vl, &vh);
                        const __m256 d0 = _mm256_set1_ps(dr[r0 + r][g0]), m0 = _mm256_set1_ps(mr[r0 + r][g0]);
                        const __m256 d1 = _mm256_set1_ps(dr[r0 + r][g1]), m1 = _mm256_set1_ps(mr[r0 + r][g1]);
                        al[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs), i4_w8(vl, 0, d0, m0), al[r]);
                        ah[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 8), i4_w8(vh, 0, d0, m0), ah[r]);
                        al[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 16), i4_w8(vl, 1, d0, m0), al[r]);
                        ah[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 24), i4_w8(vh, 1, d0, m0), ah[r]);
                        al[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 32), i4_w8(vl, 2, d1, m1), al[r]);
                        ah[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 40), i4_w8(vh, 2, d1, m1), ah[r]);
                        al[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 48), i4_w8(vl, 3, d1, m1), al[r]);
                        ah[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 56), i4_w8(vh, 3, d1, m1), ah[r]);
                    }
                }
                for (int r = 0; r < 4; r++) lo[r0 + r] = al[r], hi[r0 + r] = ah[r];
            }
            qg_finish16_avx2(lo, hi, nr, out, 0, n0, NULL, bias, bf16);
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
#if defined(__AVX512F__) || defined(DUET_AVX2)
        free(dm);
#endif
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define I4_DP 1
/* activation rows up to which the weights are decoded in registers, per call of i4_dp_rows */
#define I4_REG_ROWS 4
/*
 * bf16 activations on CPUs with AVX-512 BF16 (every m): w = d q + m per group, so a row's dot is
 *   sum_g d_g (sum_{i in g} x_i q_i) + sum_g m_g S_g,   S_g = sum_{i in g} x_i,
 * and q (0..15) is exact in bf16, as is x: a nibble becomes its bf16 by vpermw from a 16-word
 * table, and vdpbf16ps multiplies it with x (exact products, fp32 sums). A super-block of 64
 * weights costs a row 8 vector operations (one broadcast load, a variable shift, a shift, two
 * vpermw, two vdpbf16ps, two FMAs; g64: one FMA) where the fp32 table path above takes 14
 * (zero-extension, two table FMAs, three shifts, four vpermps, four FMAs).
 *
 * Both m <= I4_REG_ROWS (nibbles decoded in registers, used by every activation row) and larger m
 * (decoded once per 4 weight rows into an L1 buffer, then every activation row) run i4_dp_step on
 * the same values in the same order, and finish 16 weight rows with i4_dp_finish: bitwise equal,
 * so a sequence's tokens do not depend on its batch. These are not the fp32 table path's bits
 * (the sums are factored differently); a CPU without AVX-512 BF16, or fp32 activations, keep that
 * path.
 */

/* bf16 of 0..15, twice: vpermw reads five index bits, and the fifth is the next nibble's */
static const uint16_t I4_BF16_NIBBLES[32] __attribute__((aligned(64))) = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* Super-block s of a packed row as bf16 q: *b01 = weights 0..31, *b23 = 32..63 (in k order). The
 * 16 lanes are read twice into one register, the second copy shifted by 4, so one vpermw looks up
 * nibbles 0 and 1 of every lane (weights i and 16 + i), and the same shifted by 8 nibbles 2 and 3. */
INLINE void i4_dp_decode(const uint8_t *sb, __m512i cnt, __m512i tbl, __m512i *b01, __m512i *b23) {
    const __m512i i01 = _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)sb)), cnt);
    *b01 = _mm512_permutexvar_epi16(i01, tbl);
    *b23 = _mm512_permutexvar_epi16(_mm512_srli_epi16(i01, 8), tbl);
}

/* t += d_g (x . q) over one super-block's group(s): g32, two groups (d0, d1); g64, one (d0). */
INLINE __m512 i4_dp_step(__m512 t, __m512bh x01, __m512bh x23, __m512i b01, __m512i b23, float d0, float d1,
                         int g32) {
    const __m512 z = _mm512_setzero_ps();
    if (g32) {
        t = _mm512_fmadd_ps(_mm512_dpbf16_ps(z, x01, (__m512bh)b01), _mm512_set1_ps(d0), t);
        return _mm512_fmadd_ps(_mm512_dpbf16_ps(z, x23, (__m512bh)b23), _mm512_set1_ps(d1), t);
    }
    return _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_dpbf16_ps(z, x01, (__m512bh)b01), x23, (__m512bh)b23),
                           _mm512_set1_ps(d0), t);
}

/* S [m][ng]: each activation row's group sums (the m_g term's factor), on vdpbf16ps against ones
 * (a scalar loop over every input cost a one-row call ~1 us of its ~10-40). */
static float *i4_dp_group_sums(const uint16_t *x, int64_t xs, int m, int64_t k, int group) {
    const int64_t ng = k / group;
    float *S = (float *)malloc(sizeof(float) * (size_t)(m * ng + 1));
    if (!S) return NULL;
    const __m512bh ones = (__m512bh)_mm512_set1_epi16((short)0x3f80);
    for (int a = 0; a < m; a++)
        for (int64_t g = 0; g < ng; g++) {
            const uint16_t *xg = x + a * xs + g * group;
            __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512((const void *)xg), ones);
            if (group == 64) s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512((const void *)(xg + 32)), ones);
            S[a * ng + g] = _mm512_reduce_add_ps(s);
        }
    return S;
}

/* Finish 16 weight rows of one activation row: each row's lanes plus its sum_g m_g S_g (as lanes),
 * reduced, then the bias, stored. m16: each row's fp16 m [ng] (rows nr.. duplicates). */
INLINE void i4_dp_finish(__m512 *t, const uint16_t *const *m16, const float *S, int64_t ng, int nr, void *out,
                         int64_t out_row, int64_t n0, const void *bias, int bf16) {
    for (int r = 0; r < QG_NB; r++) {
        __m512 mv = _mm512_setzero_ps();
        for (int64_t g = 0; g < ng; g += 16) {
            const __mmask16 mk = (__mmask16)(ng - g >= 16 ? 0xffff : (1u << (ng - g)) - 1);
            const __m512 mg = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, m16[r] + g));
            mv = _mm512_fmadd_ps(mg, _mm512_maskz_loadu_ps(mk, S + g), mv);
        }
        t[r] = _mm512_add_ps(t[r], mv);
    }
    qg_finish16(t, nr, out, out_row, n0, NULL, bias, bf16);
}

/* M (1..4, a constant at each call) activation rows against a block's 16 weight rows, 4 weight
 * rows at a time: each super-block of a weight row decoded once in registers and used for every
 * activation row, all 4 x M accumulators in registers. acc [M][QG_NB]. For M > 1 this replaced the
 * buffered path below (4 weight rows decoded into L1, then read back per activation row), which
 * made two rows cost 1.65x one (a draft's two-token feed, an int4 decode batch of 2-4). */
INLINE void i4_dp_rows(const uint16_t *x, int64_t xs, const int M, const uint8_t *const *rows,
                       const float *const *dr, int64_t sbs, int64_t k, __m512i cnt, __m512i tbl, __m512 *acc,
                       const int g32) {
    for (int r0 = 0; r0 < QG_NB; r0 += 4) {
        __m512 t[4][4];
        for (int a = 0; a < M; a++)
            for (int j = 0; j < 4; j++) t[a][j] = _mm512_setzero_ps();
        const char *next = (const char *)rows[r0] + 4 * k; /* 8 rows ahead, as gemv_int4 */
        for (int64_t s = 0; s < sbs; s++) {
            _mm_prefetch(next + 128 * s, _MM_HINT_T0);
            _mm_prefetch(next + 128 * s + 64, _MM_HINT_T0);
            __m512bh x01[4], x23[4];
            for (int a = 0; a < M; a++) {
                x01[a] = (__m512bh)_mm512_loadu_si512((const void *)(x + a * xs + 64 * s));
                x23[a] = (__m512bh)_mm512_loadu_si512((const void *)(x + a * xs + 64 * s + 32));
            }
            const int64_t g0 = g32 ? 2 * s : s, g1 = g32 ? 2 * s + 1 : s;
            for (int j = 0; j < 4; j++) {
                __m512i b01, b23;
                i4_dp_decode(rows[r0 + j] + 32 * s, cnt, tbl, &b01, &b23);
                for (int a = 0; a < M; a++)
                    t[a][j] = i4_dp_step(t[a][j], x01[a], x23[a], b01, b23, dr[r0 + j][g0], dr[r0 + j][g1], g32);
            }
        }
        for (int a = 0; a < M; a++)
            for (int j = 0; j < 4; j++) acc[a * QG_NB + r0 + j] = t[a][j];
    }
}

/* i4_dp_rows with M and g32 constants (each its own copy of the loop: as run-time values their
 * tests sat in the inner loop, ~5 % of the one-row kernel). */
static void i4_dp_rows_m(const uint16_t *x, int64_t xs, int m, const uint8_t *const *rows, const float *const *dr,
                         int64_t sbs, int64_t k, __m512i cnt, __m512i tbl, __m512 *acc, int g32) {
#define I4_ROWS(M)                                                                            \
    do {                                                                                      \
        if (g32) i4_dp_rows(x, xs, M, rows, dr, sbs, k, cnt, tbl, acc, 1);                     \
        else i4_dp_rows(x, xs, M, rows, dr, sbs, k, cnt, tbl, acc, 0);                         \
    } while (0)
    switch (m) {
    case 1: I4_ROWS(1); break;
    case 2: I4_ROWS(2); break;
    case 3: I4_ROWS(3); break;
    default: I4_ROWS(4); break;
    }
#undef I4_ROWS
}

/* out [m][os] = x (bf16 [m][xs]) @ W^T + bias on the vdpbf16ps path above. Returns 0 or -1 (memory). */
static int32_t int4_dp(const uint16_t *x, int64_t xs, int m, const Int4W *w, int64_t n, const void *bias, void *out,
                       int64_t os, int bf16) {
    const int64_t k = w->k, ng = k / w->group, blocks = (n + QG_NB - 1) / QG_NB, sbs = k / 64;
    const int g32 = w->group == 32;
    float *S = i4_dp_group_sums(x, xs, m, k, w->group);
    if (!S) return -1;
    int failed = 0;
#pragma omp parallel if ((int64_t)m * n * k >= (1 << 15))
    {
        const __m512i tbl = _mm512_load_si512((const void *)I4_BF16_NIBBLES);
        const __m512i cnt = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        float *dm = (float *)malloc(sizeof(float) * 2 * QG_NB * ng);
        /* m > I4_REG_ROWS: 4 weight rows' bf16 q (k words each), and every activation row's accumulators */
        const int buffered = m > I4_REG_ROWS;
        __m512i *buf = buffered ? (__m512i *)aligned_alloc(64, (size_t)(4 * k * 2)) : NULL;
        __m512 *tacc = buffered ? (__m512 *)aligned_alloc(64, sizeof(__m512) * (size_t)(m * QG_NB)) : NULL;
        const int ok = dm && (!buffered || (buf && tacc));
        /* every thread takes part in the loop (a worksharing construct); one without memory fails */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!ok) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t n0 = b * QG_NB;
            const int nr = (int)(n - n0 < QG_NB ? n - n0 : QG_NB);
            const uint8_t *rows[QG_NB];
            const float *dr[QG_NB];
            const uint16_t *m16[QG_NB];
            block_rows_int4(w, n0, nr, dm, rows, dr, NULL, m16);
            if (m <= I4_REG_ROWS) {
                __m512 acc[I4_REG_ROWS * QG_NB];
                i4_dp_rows_m(x, xs, m, rows, dr, sbs, k, cnt, tbl, acc, g32);
                for (int a = 0; a < m; a++)
                    i4_dp_finish(acc + a * QG_NB, m16, S + a * ng, ng, nr, out, (int64_t)a * os, n0, bias, bf16);
                continue;
            }
            for (int r0 = 0; r0 < QG_NB; r0 += 4) {
                /* decode 4 weight rows once: buf [row][s][b01, b23] */
                for (int r = 0; r < 4; r++)
                    for (int64_t s = 0; s < sbs; s++)
                        i4_dp_decode(rows[r0 + r] + 32 * s, cnt, tbl, buf + (r * sbs + s) * 2, buf + (r * sbs + s) * 2 + 1);
                for (int a = 0; a < m; a++) {
                    const uint16_t *xa = x + a * xs;
                    __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
                    for (int64_t s = 0; s < sbs; s++) {
                        const __m512bh x01 = (__m512bh)_mm512_loadu_si512((const void *)(xa + 64 * s));
                        const __m512bh x23 = (__m512bh)_mm512_loadu_si512((const void *)(xa + 64 * s + 32));
                        const int64_t g0 = g32 ? 2 * s : s, g1 = g32 ? 2 * s + 1 : s;
                        const __m512i *q = buf + 2 * s;
                        t0 = i4_dp_step(t0, x01, x23, q[0], q[1], dr[r0][g0], dr[r0][g1], g32);
                        t1 = i4_dp_step(t1, x01, x23, q[2 * sbs], q[2 * sbs + 1], dr[r0 + 1][g0], dr[r0 + 1][g1], g32);
                        t2 = i4_dp_step(t2, x01, x23, q[4 * sbs], q[4 * sbs + 1], dr[r0 + 2][g0], dr[r0 + 2][g1], g32);
                        t3 = i4_dp_step(t3, x01, x23, q[6 * sbs], q[6 * sbs + 1], dr[r0 + 3][g0], dr[r0 + 3][g1], g32);
                    }
                    __m512 *ta = tacc + (int64_t)a * QG_NB + r0;
                    ta[0] = t0, ta[1] = t1, ta[2] = t2, ta[3] = t3;
                }
            }
            for (int a = 0; a < m; a++)
                i4_dp_finish(tacc + (int64_t)a * QG_NB, m16, S + a * ng, ng, nr, out, (int64_t)a * os, n0, bias, bf16);
        }
        free(dm);
        free(buf);
        free(tacc);
    }
    free(S);
    return failed ? -1 : 0;
}
#endif

/* Which path bf16 activations take: 1 the vdpbf16ps path (built where the CPU has AVX-512 BF16),
 * 0 the fp32 tables. */
int32_t qlinear_int4_path(void) {
#if defined(I4_DP)
    return 1;
#else
    return 0;
#endif
}

/* out [m][os] = x [m][xs] @ W^T + bias, W int4 as above; x bf16 (bf16 != 0) or fp32; out and bias
 * in x's dtype, or fp32 with out_f32. Returns 0, -1 when out of memory, -2 when k is not a
 * multiple of 64 or group not 32/64. */
int32_t qlinear_int4(const void *x, int64_t xs, int32_t m, int32_t k, const uint8_t *q, const uint16_t *d,
                     const uint16_t *mins, int32_t group, int64_t n, const void *bias, void *out, int64_t os,
                     int32_t bf16, int32_t out_f32) {
    if (k % 64 || (group != 32 && group != 64)) return -2;
    const Int4W w = {q, d, mins, k, group, n};
#if defined(I4_DP)
    if (bf16) return int4_dp((const uint16_t *)x, xs, m, &w, n, bias, out, os, !out_f32);
#endif
#if defined(DUET_AVX2)
    /* qlinear_int8's reason */
    if (m >= QF_MIN_ROWS) return qf_gemm(x, xs, bf16, m, k, n, &w, panel_int4, NULL, bias, out, os, bf16 && !out_f32);
#endif
    float *X = qg_x_f32(x, xs, m, k, bf16);
    if (!X) return -1;
    bf16 = bf16 && !out_f32;
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
        row_f32(w->d + (n0 + i) * ng, ng, d + 2 * i * ng), row_f32(w->mins + (n0 + i) * ng, ng, d + 2 * i * ng + ng);
    for (int64_t s = 0; s < k / 64; s++) {
        __m512i r0[16], r1[16];
        const int64_t g0 = g32 ? 2 * s : s, g1 = g32 ? 2 * s + 1 : s;
        for (int i = 0; i < 16; i++) {
            if (i >= nr) {
                r0[i] = r1[i] = _mm512_setzero_si512();
                continue;
            }
            if (s % 2 == 0 && n0 + 16 + i < w->n) /* the next block's row, a line per two super-blocks */
                _mm_prefetch((const char *)(w->q + (n0 + 16 + i) * (k / 2) + 32 * s), _MM_HINT_T1);
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
    isa = qb_isa_pick(isa);
    if (isa < 1) return -3;
#if defined(QB_BF16)
    const Int4W w = {q, d, mins, k, group, n};
    return qb_gemm(x, xs, m, k, n, &w, dequant_int4_bf16, NULL, bias, out, os, out_f32, isa);
#elif defined(DUET_AVX2)
    const Int4W w = {q, d, mins, k, group, n};
    return qf_gemm(x, xs, 1, m, k, n, &w, panel_int4, NULL, bias, out, os, !out_f32);
#else
    (void)x, (void)xs, (void)m, (void)q, (void)d, (void)mins, (void)n, (void)bias, (void)out, (void)os, (void)out_f32;
    return -3;
#endif
}
