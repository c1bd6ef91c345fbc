/*
 * int8 weight-only linear: out = (x @ q^T) * scale[n] + bias, q int8 [n][k] row-major with one
 * fp32 scale per output row (engine/quant.py). Activations bf16 or fp32, fp32 accumulation.
 *
 * Decode (m == 1) reads each weight byte once, straight from the packed matrix: 16 bytes →
 * 16 int32 → 16 fp32 → one FMA. Batches up to QG_ROWS_MAX rows do the same with each converted
 * chunk shared by up to 8 activation rows (gemv_int8_rows); larger ones dequantize 16 rows at a
 * time into a cached fp32 tile (qgemm.h). All three give bitwise-identical results. Batches of
 * bf16 activations large enough to amortize it take the bf16 GEMM path instead (qgemm_bf16.h: q
 * is exact in bf16, the scale applied in the epilogue), within bf16 tolerance of the others.
 */
#include "qgemm.h"
#include "qgemm_bf16.h"

/* Activation rows up to which batched calls take gemv_int8_rows rather than the fp32 tile path.
 * SmolLM2's 120 int8 linears, bf16 x, 2 threads, Zen 4, both builds in one process: 0.41x the
 * time at 2 rows, 0.56x at 4, 0.62x at 8, 0.72x at 16, 0.79x at 32, 0.78x at 64, 0.98x at 128.
 * (bf16 batches of BF16_GEMM_MIN_ROWS rows or more take the bf16 GEMM path where the CPU has one;
 * these rows are fp32 activations, or CPUs without it.) */
#define QG_ROWS_MAX 64

typedef struct {
    const int8_t *q;
    int64_t k;
    int64_t n; /* rows of q: the bf16 dequant prefetches the next block's rows while they exist */
} Int8W;

static void dequant_int8(const void *ctx, int64_t n0, int nr, float *tile, int64_t kp) {
    const Int8W *w = (const Int8W *)ctx;
    for (int r = 0; r < nr; r++) {
        const int8_t *src = w->q + (n0 + r) * w->k;
        float *dst = tile + (int64_t)r * kp;
        for (int64_t i = 0; i < w->k; i++) dst[i] = (float)src[i];
        for (int64_t i = w->k; i < kp; i++) dst[i] = 0.f;
    }
}

#if defined(__AVX512F__)
/* 16 weights of a row as fp32 (exact): a whole chunk, and k's tail with the bytes past k as 0.
 * The GEMV and gemv_int8_rows convert through these, so their chains are the same operations. */
INLINE __m512 i8_f32(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
INLINE __m512 i8_f32_tail(const int8_t *p, __mmask16 tail) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, p)));
}
#endif

static void gemv_int8(const float *x, int64_t k, const int8_t *q, int64_t n, const float *scale, const void *bias,
                      void *out, int bf16) {
    const int64_t blocks = (n + QG_NB - 1) / QG_NB;
#pragma omp parallel for schedule(static) if (n * k >= (1 << 15))
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * QG_NB;
        const int nr = (int)(n - n0 < QG_NB ? n - n0 : QG_NB);
#if defined(__AVX512F__)
        const int8_t *rows[QG_NB];
        for (int r = 0; r < QG_NB; r++) rows[r] = q + (n0 + (r < nr ? r : nr - 1)) * k;
        __m512 acc[QG_NB];
        const __mmask16 tail = (__mmask16)((1u << (k & 15)) - 1); /* bytes past k read as 0 */
        /* 4 rows at a time: accumulators in registers, 4 independent FMA chains */
        for (int r0 = 0; r0 < QG_NB; r0 += 4) {
            const int8_t *q0 = rows[r0], *q1 = rows[r0 + 1], *q2 = rows[r0 + 2], *q3 = rows[r0 + 3];
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            int64_t c = 0;
            /* the rows 16 on follow these in memory: fetch them a line per chunk, so the weight
             * stream is ahead of its use (rows are too short for the hardware prefetcher). 16
             * rows ahead rather than the next 4: 13.1 -> 13.9 GB/s over SmolLM2's 120 int8
             * matrices at 2 threads (4, 8, 12, 16, 24, 32 rows and an L2 hint tried, alternating
             * builds in one process); without prefetching 7.6. A prefetch past the matrix's end
             * is harmless (it never faults). */
            const char *next = (const char *)q0 + 16 * k;
            for (; c + 16 <= k; c += 16) {
                _mm_prefetch(next + 4 * c, _MM_HINT_T0);
                const __m512 xv = _mm512_loadu_ps(x + c);
                a0 = _mm512_fmadd_ps(xv, i8_f32(q0 + c), a0);
                a1 = _mm512_fmadd_ps(xv, i8_f32(q1 + c), a1);
                a2 = _mm512_fmadd_ps(xv, i8_f32(q2 + c), a2);
                a3 = _mm512_fmadd_ps(xv, i8_f32(q3 + c), a3);
            }
            if (c < k) {
                const __m512 xv = _mm512_loadu_ps(x + c);
                a0 = _mm512_fmadd_ps(xv, i8_f32_tail(q0 + c, tail), a0);
                a1 = _mm512_fmadd_ps(xv, i8_f32_tail(q1 + c, tail), a1);
                a2 = _mm512_fmadd_ps(xv, i8_f32_tail(q2 + c, tail), a2);
                a3 = _mm512_fmadd_ps(xv, i8_f32_tail(q3 + c, tail), a3);
            }
            acc[r0] = a0, acc[r0 + 1] = a1, acc[r0 + 2] = a2, acc[r0 + 3] = a3;
        }
        qg_finish16(acc, nr, out, 0, n0, scale, bias, bf16);
#elif defined(DUET_AVX2)
        const void *rows[QG_NB];
        for (int r = 0; r < QG_NB; r++) rows[r] = q + (n0 + (r < nr ? r : nr - 1)) * k;
        qg_block_avx2(x, 1, qg_pad16(k), k, rows, QG_W_I8, nr, n0, out, 0, scale, bias, bf16, 1);
#else
        for (int r = 0; r < nr; r++) {
            const int8_t *row = q + (n0 + r) * k;
            float acc = 0.f;
            for (int64_t i = 0; i < k; i++) acc += x[i] * (float)row[i];
            qg_store(out, n0 + r, acc, n0 + r, scale, bias, bf16);
        }
#endif
    }
}

#if defined(__AVX512F__)
#define I8_MR 8 /* activation rows per pass of gemv_int8_rows */

/* Activation rows [0, rows) (a constant at each call) against weight rows wr[0], wr[1]: the
 * GEMV's chain per (activation row, weight row), each weight chunk converted once for all rows. */
/* a[s] += X row s's chunk c times the weight chunks w0, w1, for s < rows */
static inline __attribute__((always_inline)) void i8_fma2(const float *X, int64_t kp, int64_t c, __m512 w0, __m512 w1,
                                                          __m512 (*a)[2], const int rows) {
    for (int s = 0; s < rows; s++) {
        const __m512 xv = _mm512_loadu_ps(X + s * kp + c);
        a[s][0] = _mm512_fmadd_ps(xv, w0, a[s][0]);
        a[s][1] = _mm512_fmadd_ps(xv, w1, a[s][1]);
    }
}

static inline __attribute__((always_inline)) void i8_rows2(const float *X, int64_t kp, int64_t k, const int8_t *q0,
                                                           const int8_t *q1, int pf, __m512 (*acc)[QG_NB], int j,
                                                           const int rows) {
    __m512 a[I8_MR][2];
    for (int s = 0; s < rows; s++) a[s][0] = a[s][1] = _mm512_setzero_ps();
    const __mmask16 tail = (__mmask16)((1u << (k & 15)) - 1);
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
        if (pf && c % 64 == 0) { /* the next block's two rows, a line every 4 chunks (gemv_int8's
                                  * reason; past the matrix it never faults): issued all at once
                                  * before the pair they waited on the miss buffers (0.92-0.98x
                                  * the time spread out, 2-12 rows) */
            _mm_prefetch((const char *)(q0 + QG_NB * k + c), _MM_HINT_T1);
            _mm_prefetch((const char *)(q1 + QG_NB * k + c), _MM_HINT_T1);
        }
        i8_fma2(X, kp, c, i8_f32(q0 + c), i8_f32(q1 + c), a, rows);
    }
    if (c < k) i8_fma2(X, kp, c, i8_f32_tail(q0 + c, tail), i8_f32_tail(q1 + c, tail), a, rows);
    for (int s = 0; s < rows; s++) acc[s][j] = a[s][0], acc[s][j + 1] = a[s][1];
}

/*
 * m > 1 rows of fp32 x [m][pad16(k)] with the GEMV's arithmetic: for each block of 16 weight
 * rows and up to I8_MR activation rows, two weight rows at a time are read and converted once
 * and run against every activation row, each (activation, weight) pair the GEMV's own chain
 * (the same FMAs in the same order, then qg_finish16), so a row's output does not depend on m.
 * The fp32 tile path (qgemm.h), which it replaces up to QG_ROWS_MAX rows, read its dequantized
 * tile from L2 for every 4 activation rows, one memory operand per FMA.
 */
static void gemv_int8_rows(const float *X, int m, int64_t k, const int8_t *q, int64_t n, const float *scale,
                           const void *bias, void *out, int64_t os, int bf16) {
    const int64_t kp = qg_pad16(k), blocks = (n + QG_NB - 1) / QG_NB;
#pragma omp parallel for schedule(static) if (n * k * m >= (1 << 15))
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * QG_NB;
        const int nr = (int)(n - n0 < QG_NB ? n - n0 : QG_NB);
        for (int m0 = 0; m0 < m; m0 += I8_MR) {
            const int mr = m - m0 < I8_MR ? m - m0 : I8_MR;
            __m512 acc[I8_MR][QG_NB];
            for (int j = 0; j < QG_NB; j += 2) {
                const int8_t *q0 = q + (n0 + (j < nr ? j : nr - 1)) * k;
                const int8_t *q1 = q + (n0 + (j + 1 < nr ? j + 1 : nr - 1)) * k;
#define I8_ROWS(r) i8_rows2(X + (int64_t)m0 * kp, kp, k, q0, q1, m0 == 0, acc, j, r)
                CONST_ROWS_SWITCH(mr, I8_MR, I8_ROWS)
#undef I8_ROWS
            }
            for (int s = 0; s < mr; s++) qg_finish16(acc[s], nr, out, (int64_t)(m0 + s) * os, n0, scale, bias, bf16);
        }
    }
}
#endif

#if defined(DUET_AVX2)
/* 2 .. QF_MIN_ROWS - 1 rows on AVX2 (a decode batch, a speculative verification): every block of 16
 * weight rows against the activation rows, each weight chunk converted in registers and shared by
 * up to 6 activation rows (qg_block_avx2): the GEMV's chains, so a row's output does not depend on
 * m. */
static void gemv_int8_rows_avx2(const float *X, int m, int64_t k, const int8_t *q, int64_t n, const float *scale,
                                const void *bias, void *out, int64_t os, int bf16) {
    const int64_t kp = qg_pad16(k), blocks = (n + QG_NB - 1) / QG_NB, esz = bf16 ? 2 : 4;
#pragma omp parallel if (n * k * m >= (1 << 15))
    for (int m0 = 0; m0 < m; m0 += QG_MB) {
        const int mb = m - m0 < QG_MB ? m - m0 : QG_MB;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * QG_NB;
            const int nr = (int)(n - n0 < QG_NB ? n - n0 : QG_NB);
            const void *rows[QG_NB];
            for (int r = 0; r < QG_NB; r++) rows[r] = q + (n0 + (r < nr ? r : nr - 1)) * k;
            qg_block_avx2(X + (int64_t)m0 * kp, mb, kp, k, rows, QG_W_I8, nr, n0, (char *)out + esz * m0 * os, os,
                          scale, bias, bf16, 0);
        }
    }
}
#endif

#if defined(DUET_AVX2)
/* Rows n0 .. n0 + nr of q as qgemm_f32.h's fp32 panel (exact), 8 rows x 8 inputs at a time. */
static void panel_int8(const void *ctx, int64_t n0, int nr, float *panel, int64_t kp) {
    const Int8W *w = (const Int8W *)ctx;
    const int64_t k = w->k;
    for (int c0 = 0; c0 < 16; c0 += 8)
        for (int64_t j0 = 0; j0 < kp; j0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) {
                const int row = c0 + i;
                if (row >= nr || j0 >= k) {
                    r[i] = _mm256_setzero_ps();
                    continue;
                }
                const int8_t *src = w->q + (n0 + row) * k + j0;
                int8_t tail[8] = {0};
                if (j0 + 8 > k) memcpy(tail, src, (size_t)(k - j0)), src = tail; /* inputs past k: 0 */
                if (j0 % 64 == 0 && n0 + 16 + row < w->n) /* the next block's row (dequant_int8_bf16's reason) */
                    _mm_prefetch((const char *)(w->q + (n0 + 16 + row) * k + j0), _MM_HINT_T1);
                r[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
            }
            qf_put8x8(r, panel, j0, c0);
        }
}
#endif

/* out [m][os] = x [m][xs] @ (q [n][k] * scale)^T + bias; x bf16 (bf16 != 0) or fp32; out and
 * bias in x's dtype, or fp32 with out_f32 (the logits). Returns 0, or -1 when out of memory.
 * On AVX2, calls of QF_MIN_ROWS rows or more take the fp32 panel GEMM (qgemm_f32.h) whatever x's
 * dtype, as AVX-512 BF16 CPUs' bf16 batches take theirs (engine/qlinear.py). */
int32_t qlinear_int8(const void *x, int64_t xs, int32_t m, int32_t k, const int8_t *q, const float *scale,
                     int64_t n, const void *bias, void *out, int64_t os, int32_t bf16, int32_t out_f32) {
#if defined(DUET_AVX2)
    if (m >= QF_MIN_ROWS) {
        const Int8W w = {q, k, n};
        return qf_gemm(x, xs, bf16, m, k, n, &w, panel_int8, scale, bias, out, os, bf16 && !out_f32);
    }
#endif
    float *X = qg_x_f32(x, xs, m, k, bf16);
    if (!X) return -1;
    bf16 = bf16 && !out_f32;
    if (m == 1) {
        gemv_int8(X, k, q, n, scale, bias, out, bf16);
#if defined(__AVX512F__)
    } else if (m <= QG_ROWS_MAX) {
        gemv_int8_rows(X, m, k, q, n, scale, bias, out, os, bf16);
#elif defined(DUET_AVX2)
    } else if (m < QF_MIN_ROWS) { /* every m left here (larger calls took qf_gemm above) */
        gemv_int8_rows_avx2(X, m, k, q, n, scale, bias, out, os, bf16);
#endif
    } else {
        const Int8W w = {q, k, n};
        qg_gemm(X, m, k, n, &w, dequant_int8, out, os, scale, bias, bf16);
    }
    free(X);
    return 0;
}

/* Which GEMM path qlinear_int8_bf16 / qlinear_int4_bf16 run here: 2 AMX, 1 AVX-512 BF16, 3 AVX2's
 * fp32 panels (which qlinear_int8 / qlinear_int4 take themselves from QF_MIN_ROWS rows, fp32 x
 * too), 0 none (the callers keep qlinear_int8 / qlinear_int4). */
int32_t qgemm_bf16_isa(void) { return qb_isa(); }

#if defined(QB_BF16)
/* Rows n0 .. n0 + nr of q as bf16 (exact) into the panel, 32 k at a time: 16 rows of 32 bytes
 * widen to 16 vectors of 16 pairs, then one 16x16 transpose gives the panel's 16 pair rows. */
static void dequant_int8_bf16(const void *ctx, int64_t n0, int nr, uint32_t *panel, int64_t kp) {
    const Int8W *w = (const Int8W *)ctx;
    const int64_t k = w->k;
    for (int64_t c = 0; c < kp; c += 32) {
        const __mmask32 mk = k - c >= 32 ? 0xffffffffu : (1u << (k - c)) - 1; /* bytes past k read as 0 */
        __m512i r[16];
        for (int i = 0; i < 16; i++) {
            if (i >= nr) {
                r[i] = _mm512_setzero_si512();
                continue;
            }
            /* The next block's row, a line per two chunks, to L2: 16 rows of 32 bytes a chunk are
             * too short a stream for the hardware prefetcher, and the loads stalled here
             * (SmolLM2's 120 matrices at one row, 2 threads, Zen 4, one process: 13.9 -> 9.4 ms;
             * to L1 it was 10.1, evicted by the panel's stores before use) */
            if (c % 64 == 0 && n0 + 16 + i < w->n)
                _mm_prefetch((const char *)(w->q + (n0 + 16 + i) * k + c), _MM_HINT_T1);
            const __m256i b = _mm256_maskz_loadu_epi8(mk, w->q + (n0 + i) * k + c);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
            r[i] = qb_pairs(lo, hi);
        }
        transpose16(r);
        for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(panel + (c / 2 + p) * 16), r[p]);
    }
}
#endif

/* qlinear_int8 for bf16 x (bf16 out, or fp32 with out_f32) on the bf16 GEMM path. isa: 0 the
 * best available, else 1 / 2 / 3 (tests). Returns 0, -1 when out of memory, -3 when the path is
 * not available in this build or process. */
int32_t qlinear_int8_bf16(const uint16_t *x, int64_t xs, int32_t m, int32_t k, const int8_t *q, const float *scale,
                          int64_t n, const uint16_t *bias, void *out, int64_t os, int32_t out_f32, int32_t isa) {
    isa = qb_isa_pick(isa);
    if (isa < 1) return -3;
#if defined(QB_BF16)
    const Int8W w = {q, k, n};
    return qb_gemm(x, xs, m, k, n, &w, dequant_int8_bf16, scale, bias, out, os, out_f32, isa);
#elif defined(DUET_AVX2)
    const Int8W w = {q, k, n};
    return qf_gemm(x, xs, 1, m, k, n, &w, panel_int8, scale, bias, out, os, !out_f32);
#else
    (void)x, (void)xs, (void)m, (void)k, (void)q, (void)scale, (void)n, (void)bias, (void)out, (void)os, (void)out_f32;
    return -3;
#endif
}
