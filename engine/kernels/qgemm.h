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

#if defined(DUET_AVX2)
/* qg_finish16 for 16-lane accumulators held as halves (common.h: transpose_reduce16_avx2, the
 * same bits). */
INLINE void qg_finish16_avx2(const __m256 *lo, const __m256 *hi, int cnt, void *out, int64_t out_row, int64_t n0,
                             const float *scale, const void *bias, int bf16) {
    float r[16];
    transpose_reduce16_avx2(lo, hi, r);
    for (int i = 0; i < cnt; i++) qg_store(out, out_row + n0 + i, r[i], n0 + i, scale, bias, bf16);
}

#define QG_AR 6 /* activation rows per pass of qg_block_avx2 */

enum { QG_W_I8 = 0, QG_W_F32 = 1 }; /* weight rows given as int8 (converted in registers) or fp32 */

/* Eight weights of a row from element i, as fp32 (exact). */
INLINE __m256 qg_w8(const void *row, int64_t i, const int kind) {
    if (kind == QG_W_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + i))));
    return _mm256_loadu_ps((const float *)row + i);
}

/*
 * lo/hi [s][j] += the GEMV's 16 lane chains of activation row s (X, rows kp apart) against weight
 * row wr[j] over the chunks [c0, c1) (16 inputs each), for s < R, j < W (constants at each call,
 * so the accumulators are registers). Lane l of a chain takes input 16 c + l in chunk order, as
 * the AVX-512 loops do. H (a constant): 0 both halves of each chunk (2 R W accumulators: R W <= 8
 * and W + 1 more fit AVX2's 16), 1 lanes 0-7 only (lo), 2 lanes 8-15 only (hi): the two halves'
 * chains are independent, so one half at a time over every chunk gives the same bits with R W
 * accumulators, room for twice the rows per converted weight vector. pf (or NULL): a line of the
 * rows 16 ahead per chunk, W rows' worth (the GEMV's prefetch).
 */
static inline __attribute__((always_inline)) void qg_dots_avx2(const float *X, int64_t kp, int64_t c0, int64_t c1,
                                                                 const void *const *wr, const int R, const int W,
                                                                 const int kind, const int H, __m256 (*lo)[4],
                                                                 __m256 (*hi)[4], const char *pf) {
    __m256 al[QG_AR][4], ah[QG_AR][4];
    for (int s = 0; s < R; s++)
        for (int j = 0; j < W; j++) al[s][j] = lo[s][j], ah[s][j] = hi[s][j];
    for (int64_t c = c0; c < c1; c += 16) {
        if (pf) _mm_prefetch(pf + W * c, _MM_HINT_T0);
        for (int h = 0; h < 16; h += 8) {
            if ((H == 1 && h) || (H == 2 && !h)) continue;
            __m256 w[4];
            for (int j = 0; j < W; j++) w[j] = qg_w8(wr[j], c + h, kind);
            for (int s = 0; s < R; s++) {
                __m256 xv = _mm256_loadu_ps(X + s * kp + c + h);
                /* one load of x for its W FMAs: folded into each FMA as a memory operand (what gcc
                 * chooses), loads outnumber FMAs and bound the loop */
                if (W > 1) __asm__("" : "+x"(xv));
                for (int j = 0; j < W; j++) {
                    if (h) ah[s][j] = _mm256_fmadd_ps(xv, w[j], ah[s][j]);
                    else al[s][j] = _mm256_fmadd_ps(xv, w[j], al[s][j]);
                }
            }
        }
    }
    for (int s = 0; s < R; s++)
        for (int j = 0; j < W; j++) lo[s][j] = al[s][j], hi[s][j] = ah[s][j];
}

/*
 * Activation rows [0, m) of X (fp32, rows kp apart, zero padded) against one block of weight rows
 * wr[0..16) (nr of them real, the rest repeating the last), every output the GEMV's chains then
 * its transpose reduction, stored with scale and bias: the same bits for a row whatever m is, and
 * the AVX-512 loops' bits. Weight rows are int8 (k bytes; the last partial chunk from a zeroed
 * copy, as the AVX-512 loops' masked loads) or an fp32 tile (kp, zero padded). A single row runs
 * against 4 weight rows, both halves at once (more chains in flight for the GEMV). int8: 2-6 rows
 * a pass, one half of the lanes at a time (qg_dots_avx2's H), against 4 weight rows (2 rows) or 2
 * (3-6), so each weight vector's conversion (a load, a widening, a convert) serves up to 6 rows
 * rather than 3: SmolLM2's int8 linears, one Zen 3 thread, in-process A/B against 3 rows a pass
 * both halves at once, CPU time, load 16-21: 0.76x the time at 4 rows, 0.86-0.87x at 7-8, 0.89x
 * at 12, 0.96x at 15, 1.02x at 2. An fp32 tile (int4) keeps 3 rows a pass against 2 weight rows,
 * both halves: the same layout one half at a time measured 1.03-1.2x at 2-8 rows (its weight
 * vectors are plain loads, nothing to share). pf: prefetch the next block (the GEMV's; only with
 * m == 1).
 */
static void qg_block_avx2(const float *X, int m, int64_t kp, int64_t k, const void *const *wr, int kind, int nr,
                          int64_t n0, void *out, int64_t os, const float *scale, const void *bias, int bf16, int pf) {
    const int64_t full = kind == QG_W_I8 ? k & ~(int64_t)15 : kp;
    int8_t tails[16][16];
    const void *tw[16];
    if (full < kp)
        for (int j = 0; j < 16; j++) {
            memset(tails[j], 0, 16);
            memcpy(tails[j], (const int8_t *)wr[j] + full, (size_t)(k - full));
            tw[j] = tails[j];
        }
    /* int8: passes of at most QG_AR rows, as even as they go (7 rows: 4 + 3, not 6 + 1); an fp32
     * tile: 3 rows a pass */
    const int rmax = kind == QG_W_I8 ? QG_AR : 3, passes = (m + rmax - 1) / rmax;
    for (int m0 = 0, i = 0; m0 < m; i++) {
        const int left = m - m0,
                  R = kind == QG_W_I8 ? left / (passes - i) + (left % (passes - i) != 0) : left < 3 ? left : 3;
        __m256 lo[QG_AR][16], hi[QG_AR][16];
        const float *Xs = X + (int64_t)m0 * kp;
        for (int j0 = 0; j0 < 16;) {
            const int W = R == 1 || (R == 2 && kind == QG_W_I8) ? 4 : 2;
            __m256 bl[QG_AR][4], bh[QG_AR][4];
            for (int s = 0; s < QG_AR; s++)
                for (int j = 0; j < 4; j++) bl[s][j] = bh[s][j] = _mm256_setzero_ps();
            const char *p = pf ? (const char *)wr[j0] + 16 * k : NULL;
#define QG_DOTH(r, w, K, H)                                                                         \
    do {                                                                                            \
        qg_dots_avx2(Xs, kp, 0, full, wr + j0, r, w, K, H, bl, bh, p);                              \
        if (full < kp) qg_dots_avx2(Xs + full, kp, 0, 16, tw + j0, r, w, QG_W_I8, H, bl, bh, NULL);  \
    } while (0)
#define QG_DOTS(r, w, K)                                                                            \
    do {                                                                                            \
        if (r == 1 || K == QG_W_F32) QG_DOTH(r, w, K, 0);                                           \
        else {                                                                                      \
            QG_DOTH(r, w, K, 1);                                                                    \
            QG_DOTH(r, w, K, 2);                                                                    \
        }                                                                                           \
    } while (0)
            if (kind == QG_W_I8) {
                switch (R) {
                case 1: QG_DOTS(1, 4, QG_W_I8); break;
                case 2: QG_DOTS(2, 4, QG_W_I8); break;
                case 3: QG_DOTS(3, 2, QG_W_I8); break;
                case 4: QG_DOTS(4, 2, QG_W_I8); break;
                case 5: QG_DOTS(5, 2, QG_W_I8); break;
                default: QG_DOTS(6, 2, QG_W_I8); break;
                }
            } else {
                if (R == 1) QG_DOTS(1, 4, QG_W_F32);
                else if (R == 2) QG_DOTS(2, 2, QG_W_F32);
                else QG_DOTS(3, 2, QG_W_F32);
            }
#undef QG_DOTS
#undef QG_DOTH
            for (int s = 0; s < R; s++)
                for (int j = 0; j < W; j++) lo[s][j0 + j] = bl[s][j], hi[s][j0 + j] = bh[s][j];
            j0 += W;
        }
        for (int s = 0; s < R; s++)
            qg_finish16_avx2(lo[s], hi[s], nr, out, (int64_t)(m0 + s) * os, n0, scale, bias, bf16);
        m0 += R;
    }
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
#elif defined(DUET_AVX2)
    const void *wr[16];
    for (int b = 0; b < 16; b++) wr[b] = tile + (int64_t)(b < nr ? b : nr - 1) * kp;
    qg_block_avx2(X, m, kp, kp, wr, QG_W_F32, nr, n0, out, os, scale, bias, bf16, 0);
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
