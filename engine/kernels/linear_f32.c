/*
 * fp32 linear layers at few rows (decode steps): out = x @ W^T (+ bias), fp32 x and W, W [n][k] as
 * the checkpoint stores it (nothing packed), fp32 sums.
 *
 * Why a kernel of our own where fp32 layers otherwise run F.linear: a decode step's layers run in
 * one C call (decode_layers.c), which must compute what the Python loop computes, bit for bit; both
 * call this. A step of a few rows reads every weight once, so it is bound by memory bandwidth and a
 * plain dot-product GEMV reaches it; larger batches (prefill) keep F.linear's GEMM
 * (engine/linear.py: F32_KERNEL_MAX_ROWS).
 *
 * Arithmetic: output (r, i) = the 8 lane sums of x[r][k] * W[i][k] over k = l (mod 8), each one FMA
 * chain in k order, then one fixed tree of adds over the lanes, then + bias: the order depends on k
 * alone, so a row's result is the same whatever rows are computed beside it (single-stream decode,
 * a decode batch, a speculative verification: bitwise alike), and on AVX2 and AVX-512 builds (both
 * run these 8 lanes). The portable C sums in order (within fp32 rounding of them).
 * Threads: blocks of 4 weight rows over OpenMP; each block runs the x rows two at a time (8
 * accumulators) while its rows sit in L1.
 */
#include <stdint.h>

#include "common.h"
#include "vec8.h"

#if defined(DUET_VEC8)
/* out[r][i0 + j] for j < nw (<= 4) weight rows wr[j] and xr rows (1 or 2, a constant). */
INLINE void dot_block(const float *const *wr, const float *x, int64_t xs, int xr, int32_t k, __m128 *sums) {
    __m256 acc[2][4];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    int32_t c = 0;
    for (; c + 8 <= k; c += 8) {
        __m256 xv[2];
        for (int r = 0; r < xr; r++) xv[r] = _mm256_loadu_ps(x + r * xs + c);
        for (int j = 0; j < 4; j++) {
            const __m256 wv = _mm256_loadu_ps(wr[j] + c);
            for (int r = 0; r < xr; r++) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]);
        }
    }
    if (c < k) {
        const __m256i mk = vec8_mask(k - c);
        __m256 xv[2];
        for (int r = 0; r < xr; r++) xv[r] = _mm256_maskload_ps(x + r * xs + c, mk);
        for (int j = 0; j < 4; j++) {
            const __m256 wv = _mm256_maskload_ps(wr[j] + c, mk);
            for (int r = 0; r < xr; r++) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]);
        }
    }
    for (int r = 0; r < xr; r++) {
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
        sums[r] = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    }
}
#endif

/* out [m][os] = x [m][xs] @ W^T + bias (fp32 [n] or NULL), W fp32 [n][k] rows k apart. Returns 0. */
int32_t linear_f32(const float *x, int64_t xs, int32_t m, int32_t k, const float *w, int64_t n, const float *bias,
                   float *out, int64_t os) {
    const int64_t blocks = (n + 3) / 4;
#pragma omp parallel for schedule(static) if (n * (int64_t)k * m >= (1 << 16))
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t i0 = 4 * b;
        const int nw = n - i0 < 4 ? (int)(n - i0) : 4;
#if defined(DUET_VEC8)
        const float *wr[4];
        for (int j = 0; j < 4; j++) wr[j] = w + (i0 + (j < nw ? j : 0)) * (int64_t)k; /* padding rows: not stored */
        float bs[4] = {0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < nw; j++) bs[j] = bias ? bias[i0 + j] : 0.f;
        for (int32_t r = 0; r < m; r += 2) {
            __m128 sums[2];
            const int xr = m - r >= 2 ? 2 : 1;
            if (xr == 2) dot_block(wr, x + r * xs, xs, 2, k, sums);
            else dot_block(wr, x + r * xs, xs, 1, k, sums);
            for (int q = 0; q < xr; q++) {
                float o[4];
                _mm_storeu_ps(o, sums[q]);
                for (int j = 0; j < nw; j++) out[(r + q) * os + i0 + j] = bias ? o[j] + bs[j] : o[j];
            }
        }
#else
        for (int32_t r = 0; r < m; r++)
            for (int j = 0; j < nw; j++) {
                const float *wr = w + (i0 + j) * (int64_t)k, *xr = x + r * xs;
                float acc = 0.f;
                for (int32_t c = 0; c < k; c++) acc += xr[c] * wr[c];
                out[r * os + i0 + j] = bias ? acc + bias[i0 + j] : acc;
            }
#endif
    }
    return 0;
}
