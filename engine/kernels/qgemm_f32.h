/*
 * The GEMM path of the linears on AVX2 CPUs (no AVX-512, no bf16 dot products; DUET_AVX2): what
 * qgemm_bf16.h's vdpbf16ps path is on AVX-512 BF16 CPUs, for the weight-only linears' batches of
 * QF_MIN_ROWS rows or more (prefill, batched decode) and for bf16 weights' batches of
 * linear_bf16.c's LB_PANEL_MIN_ROWS or more:
 * out[m, n] = sum_k x[m, k] * W[n, k] (* scale[n]) (+ bias[n]), fp32 products and sums, one
 * rounding at the store. x is bf16 or fp32 (copied once to fp32 rows), W is given per block of 16
 * rows by a panel function (int8 q exact, int4 fma(d, q, m) exact, bf16 widened: never rounded).
 *
 * Each thread takes a block of 16 weight rows, writes it as an fp32 panel [kp][16] (the 16 rows'
 * values at one input side by side, two 8-lane vectors), then runs every activation row against
 * it, 6 rows at a time: a broadcast input times the two vectors, two FMAs a row (12 accumulators,
 * the panel's two vectors and a broadcast in AVX2's 16 registers). Each output is one FMA chain
 * over k whatever m is, so a row's result does not depend on the rows beside it; the chain takes
 * the inputs of each pair (2p, 2p + 1) odd first, as vdpbf16ps adds them (the panel's row 2p
 * holds input 2p + 1 and the activations are copied in the same order), so bf16 weights give the
 * AVX-512 BF16 path's sums wherever vdpbf16ps rounds each addition as an FMA does.
 *
 * Why not the GEMV's chains (qgemm.h, 16 lanes per output then a reduction, batch-invariant with
 * the one-row call): that form loads its weights and activations for every FMA pair and ran at
 * ~55 GFLOP/s of one Zen 3 core against torch's fp32 GEMM's ~80 here; this one's loads are one
 * broadcast per two FMAs.
 */
#ifndef DUET_KERNELS_QGEMM_F32_H
#define DUET_KERNELS_QGEMM_F32_H

#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(DUET_AVX2)

/* activation rows from which the weight-only linears take this path (engine/qlinear.py's
 * BF16_GEMM_MIN_ROWS: below it they keep the GEMV's arithmetic) */
#define QF_MIN_ROWS 16
#define QF_MR 6 /* activation rows per pass over a panel */

INLINE int64_t qf_pad32(int64_t k) { return (k + 31) & ~(int64_t)31; }

/* Rows n0 .. n0 + nr (nr <= 16) of W as the panel [kp][16], fp32, input 2p + 1 in row 2p and 2p in
 * row 2p + 1; rows nr .. 15 and inputs past k zero. */
typedef void (*qf_panel_fn)(const void *ctx, int64_t n0, int nr, float *panel, int64_t kp);

/* 8 rows x 8 inputs (r[i]: row i's inputs j0 .. j0 + 7, exact fp32) into the panel at input j0
 * (pair-swapped rows), as columns c0 .. c0 + 7: an 8x8 transpose. */
INLINE void qf_put8x8(__m256 *r, float *panel, int64_t j0, int c0) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    /* column j (input j0 + j) of the 8 rows; stored at panel row j0 + (j ^ 1) */
    const __m256 c[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                         _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                         _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                         _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
    for (int j = 0; j < 8; j++) _mm256_store_ps(panel + (j0 + (j ^ 1)) * 16 + c0, c[j]);
}

/* Activation rows [0, R) (R <= QF_MR, a constant at each call) of X (fp32, rows kp apart, pair-swapped
 * like the panel) against the panel: acc [R][16]. */
static inline __attribute__((always_inline)) void qf_rows(const float *X, int64_t kp, const float *panel, float *acc,
                                                            const int R) {
    __m256 a[QF_MR][2];
    for (int s = 0; s < R; s++) a[s][0] = a[s][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < kp; i++) {
        const __m256 w0 = _mm256_load_ps(panel + 16 * i), w1 = _mm256_load_ps(panel + 16 * i + 8);
        for (int s = 0; s < R; s++) {
            const __m256 xb = _mm256_broadcast_ss(X + s * kp + i);
            a[s][0] = _mm256_fmadd_ps(xb, w0, a[s][0]);
            a[s][1] = _mm256_fmadd_ps(xb, w1, a[s][1]);
        }
    }
    for (int s = 0; s < R; s++) {
        _mm256_storeu_ps(acc + 16 * s, a[s][0]);
        _mm256_storeu_ps(acc + 16 * s + 8, a[s][1]);
    }
}

/* x [m rows, stride xs] (bf16 or fp32) as fp32 [m][kp], each pair of inputs swapped, zero padded. */
static float *qf_x(const void *x, int64_t xs, int m, int64_t k, int xbf16, int64_t kp) {
    float *X = (float *)aligned_alloc(64, (size_t)m * (size_t)kp * 4 + 64);
    if (!X) return NULL;
    for (int r = 0; r < m; r++) {
        float *o = X + (int64_t)r * kp;
        for (int64_t i = 0; i < kp; i++) o[i ^ 1] = i < k ? load_elem(x, r * xs + i, xbf16) : 0.f;
    }
    return X;
}

/* Outputs n0 .. n0 + cnt of one row: scale, bias (in the output's dtype), one rounding. */
INLINE void qf_store(const float *acc, int cnt, int64_t n0, const float *scale, const void *bias, int bias_bf16,
                     void *out_row, int obf16) {
    for (int i = 0; i < cnt; i++) {
        float v = acc[i];
        if (scale) v *= scale[n0 + i];
        if (bias) v += load_elem(bias, n0 + i, bias_bf16);
        store_elem(out_row, n0 + i, v, obf16);
    }
}

/*
 * out [m][os] = x [m][xs] @ W^T (* scale) (+ bias), W [n][k] given by panel(ctx, ...); x bf16
 * (xbf16) or fp32, bias in x's dtype, out bf16 (obf16) or fp32. Returns 0, -1 when out of memory.
 */
static int32_t qf_gemm(const void *x, int64_t xs, int xbf16, int m, int k, int64_t n, const void *ctx,
                       qf_panel_fn panel_fn, const float *scale, const void *bias, void *out, int64_t os, int obf16) {
    const int64_t kp = qf_pad32(k), blocks = (n + 15) / 16, esz = obf16 ? 2 : 4;
    float *X = qf_x(x, xs, m, k, xbf16, kp);
    if (!X) return -1;
    int fail = 0;
#pragma omp parallel if ((int64_t)m * n * k >= (1 << 15))
    {
        float *panel = (float *)aligned_alloc(64, (size_t)kp * 16 * 4);
        float acc[QF_MR * 16];
        if (!panel) {
#pragma omp atomic write
            fail = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!panel) continue;
            const int64_t n0 = 16 * b;
            const int nr = (int)(n - n0 < 16 ? n - n0 : 16);
            panel_fn(ctx, n0, nr, panel, kp);
            for (int m0 = 0; m0 < m; m0 += QF_MR) {
                const int R = m - m0 < QF_MR ? m - m0 : QF_MR;
                switch (R) { /* a constant count each (CONST_ROWS_SWITCH's reason) */
                case 1: qf_rows(X + (int64_t)m0 * kp, kp, panel, acc, 1); break;
                case 2: qf_rows(X + (int64_t)m0 * kp, kp, panel, acc, 2); break;
                case 3: qf_rows(X + (int64_t)m0 * kp, kp, panel, acc, 3); break;
                case 4: qf_rows(X + (int64_t)m0 * kp, kp, panel, acc, 4); break;
                case 5: qf_rows(X + (int64_t)m0 * kp, kp, panel, acc, 5); break;
                default: qf_rows(X + (int64_t)m0 * kp, kp, panel, acc, QF_MR); break;
                }
                for (int s = 0; s < R; s++)
                    qf_store(acc + 16 * s, nr, n0, scale, bias, xbf16, (char *)out + (int64_t)(m0 + s) * os * esz, obf16);
            }
        }
        free(panel);
    }
    free(X);
    return fail ? -1 : 0;
}

#endif /* DUET_AVX2 */

#endif
