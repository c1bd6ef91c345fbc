/*
 * Shared parts of the weight-only quantized linears (qgemv_int8.c, qgemv_int4.c):
 * out[m, n] = sum_k x[m, k] * W[n, k] (* scale[n]) (+ bias[n]), x and out in bf16 or fp32,
 * W dequantized on the fly, fp32 accumulation, one rounding at the store.
 *
 * Two paths per format, bitwise equal to each other (so a sequence's tokens do not depend on
 * the batch it decodes in):
 * - m == 1 (decode GEMV): 16 weight rows at a time, each row's packed bytes read once and
 *   turned into fp32 in registers; never a dequantized copy of the matrix.
 * - m > 1 (batched decode, prefill): each thread dequantizes 16 rows into an fp32 tile in its
 *   cache, then a 4x4 register-blocked fp32 micro-kernel runs every activation row against it
 *   (int8 up to QG_ROWS_MAX rows: the GEMV's loop shared by 8 activation rows instead,
 *   qgemv_int8.c's gemv_int8_rows).
 * Both accumulate lane l of row n over k = 16 c + l in chunk order, then reduce the 16 lanes
 * with transpose_reduce16 (a fixed tree per row), then apply scale, then bias.
 * (bf16 batches of engine/qlinear.py's BF16_GEMM_MIN_ROWS or more take the bf16 GEMM path of
 * qgemm_bf16.h instead, where the CPU has one: equal to these within bf16 tolerance. int4 with bf16
 * activations below that takes qgemv_int4.c's vdpbf16ps path on such CPUs, whose one-row and
 * batched calls are bitwise equal to each other in the same way.)
 *
 * x is first copied to fp32 rows padded with zeros to a multiple of 16, so every chunk is full;
 * the weights' padding is zero too (masked loads / zeroed tile).
 */
#ifndef DUET_KERNELS_QGEMM_H
#define DUET_KERNELS_QGEMM_H

#include <stdlib.h>
#include <string.h>

#include "common.h"

#define QG_NB 16 /* weight rows per block (one transpose_reduce16) */

INLINE int64_t qg_pad16(int64_t k) { return (k + 15) & ~(int64_t)15; }

/* x [m rows, stride xs elements] → malloc'd fp32 [m][pad16(k)], zero padded. */
static float *qg_x_f32(const void *x, int64_t xs, int m, int k, int bf16) {
    const int64_t kp = qg_pad16(k);
    float *out = (float *)aligned_alloc(64, (size_t)(m * kp * 4 + 64));
    if (!out) return NULL;
    for (int r = 0; r < m; r++) {
        float *o = out + r * kp;
        for (int64_t i = 0; i < k; i++) o[i] = load_elem(x, r * xs + i, bf16);
        for (int64_t i = k; i < kp; i++) o[i] = 0.f;
    }
    return out;
}

/* The output for row n: the reduced dot product, times the row scale (if any), plus bias. */
INLINE void qg_store(void *out, int64_t idx, float acc, int64_t n, const float *scale, const void *bias, int bf16) {
    if (scale) acc *= scale[n];
    if (bias) acc += load_elem(bias, n, bf16);
    store_elem(out, idx, acc, bf16);
}

#if defined(__AVX512F__)
/* Reduce up to 16 accumulators (rows n0..n0+cnt of one activation row) and store them. */
INLINE void qg_finish16(const __m512 *acc, int cnt, void *out, int64_t out_row, int64_t n0, const float *scale,
                        const void *bias, int bf16) {
    float r[16];
    _mm512_storeu_ps(r, transpose_reduce16(acc));
    for (int i = 0; i < cnt; i++) qg_store(out, out_row + n0 + i, r[i], n0 + i, scale, bias, bf16);
}
#endif

/*
 * The m > 1 path for one block of rows: tile = fp32 [nr <= 16 rows][kp], x fp32 [m][kp].
 * Rows of the tile beyond nr and activation rows beyond m are computed on duplicates and not
 * stored, so the micro-kernel is always 4x4.
 */
static void qg_tile_gemm(const float *X, int m, int64_t kp, const float *tile, int nr, int64_t n0, void *out,
                         int64_t os, const float *scale, const void *bias, int bf16) {
#if defined(__AVX512F__)
    for (int mi = 0; mi < m; mi += 4) {
        const float *xr[4];
        for (int a = 0; a < 4; a++) xr[a] = X + (int64_t)(mi + a < m ? mi + a : m - 1) * kp;
        for (int ni = 0; ni < nr; ni += 4) {
            const float *wr[4];
            for (int b = 0; b < 4; b++) wr[b] = tile + (int64_t)(ni + b < nr ? ni + b : nr - 1) * kp;
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t c = 0; c < kp; c += 16) {
                const __m512 w0 = _mm512_loadu_ps(wr[0] + c), w1 = _mm512_loadu_ps(wr[1] + c);
                const __m512 w2 = _mm512_loadu_ps(wr[2] + c), w3 = _mm512_loadu_ps(wr[3] + c);
                for (int a = 0; a < 4; a++) {
                    const __m512 xv = _mm512_loadu_ps(xr[a] + c);
                    acc[4 * a + 0] = _mm512_fmadd_ps(xv, w0, acc[4 * a + 0]);
                    acc[4 * a + 1] = _mm512_fmadd_ps(xv, w1, acc[4 * a + 1]);
                    acc[4 * a + 2] = _mm512_fmadd_ps(xv, w2, acc[4 * a + 2]);
                    acc[4 * a + 3] = _mm512_fmadd_ps(xv, w3, acc[4 * a + 3]);
                }
            }
            float r[16];
            _mm512_storeu_ps(r, transpose_reduce16(acc));
            for (int a = 0; a < 4 && mi + a < m; a++)
                for (int b = 0; b < 4 && ni + b < nr; b++)
                    qg_store(out, (int64_t)(mi + a) * os + n0 + ni + b, r[4 * a + b], n0 + ni + b, scale, bias, bf16);
        }
    }
#else
    for (int mi = 0; mi < m; mi++)
        for (int ni = 0; ni < nr; ni++) {
            float acc = 0.f;
            for (int64_t c = 0; c < kp; c++) acc += X[mi * kp + c] * tile[ni * kp + c];
            qg_store(out, (int64_t)mi * os + n0 + ni, acc, n0 + ni, scale, bias, bf16);
        }
#endif
}

/* Activation rows per pass of the m > 1 path: their fp32 copy stays in L2 while every block of
 * weight rows runs against it (each block is dequantized once per pass). */
#define QG_MB 64

/*
 * Driver of the m > 1 path. `dequant(ctx, n0, nr, tile, kp)` writes rows n0..n0+nr of the weight
 * as fp32 into tile [nr][kp] (zero padded).
 */
typedef void (*qg_dequant_fn)(const void *ctx, int64_t n0, int nr, float *tile, int64_t kp);

static void qg_gemm(const float *X, int m, int k, int64_t n, const void *ctx, qg_dequant_fn dequant, void *out,
                    int64_t os, const float *scale, const void *bias, int bf16) {
    const int64_t kp = qg_pad16(k), blocks = (n + QG_NB - 1) / QG_NB;
#pragma omp parallel if ((int64_t)m * n * k >= (1 << 15))
    {
        float *tile = (float *)aligned_alloc(64, (size_t)(QG_NB * kp * 4));
        for (int m0 = 0; m0 < m; m0 += QG_MB) {
            const int mb = m - m0 < QG_MB ? m - m0 : QG_MB;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t n0 = b * QG_NB;
                const int nr = (int)(n - n0 < QG_NB ? n - n0 : QG_NB);
                dequant(ctx, n0, nr, tile, kp);
                qg_tile_gemm(X + (int64_t)m0 * kp, mb, kp, tile, nr, n0, (char *)out + (bf16 ? 2 : 4) * m0 * os, os,
                             scale, bias, bf16);
            }
        }
        free(tile);
    }
}

#endif
