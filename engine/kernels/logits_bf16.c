/*
 * The logits GEMM in bf16 with fp32 output: out fp32 [m][os] = x bf16 [m][xs] @ W bf16 [n][k]^T.
 *
 * Why: a bf16 lm_head that rounds its output to bf16 ties tokens whose fp32 logits differ (issue
 * 25: "The" and "L" both -1.8766 for "What is the capital of France?"); vLLM's sampler takes fp32
 * logits. Every product of two bf16 values is exact in fp32, so with fp32 accumulation the only
 * rounding left is the accumulation's own.
 *
 * Two paths, bitwise equal (a sequence's logits do not depend on the batch it decodes in):
 * - m == 1 (decode): 16 weight rows per block, 4 at a time with their accumulators in registers.
 * - m > 1: the same blocks of 16 weight rows, every activation row against them with a 4x4
 *   register block, so the block is read from memory once per pass.
 * Both accumulate lane l over k = 32 c + 2 l, 2 l + 1 (vdpbf16ps pairs; with avx512f alone, the
 * same pair order with two FMAs) in chunk order, then reduce the 16 lanes with
 * transpose_reduce16. k's tail is zero-masked.
 * The first activation pass over a block prefetches the same rows of the next block, a line per
 * chunk: decode's 1-row logits of SmolLM2 (56 MB of bf16 weights) 3.7 -> 2.6 ms at 2 threads, AMX
 * Xeon (the rows are too short for the hardware prefetcher; qgemv_int8.c does the same).
 */
#include <stdlib.h>

#include "common.h"

#define LB_NB 16

#if defined(__AVX512F__)
/* acc += pairs of x and w (32 bf16 each, given as 512-bit integer vectors). */
INLINE __m512 dot_pairs(__m512 acc, __m512i x, __m512i w) {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
#else
    /* vdpbf16ps adds the odd product, then the even one (each product exact in fp32) */
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 xo = _mm512_castsi512_ps(_mm512_and_si512(x, hi)), wo = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
    const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    acc = _mm512_fmadd_ps(xo, wo, acc);
    return _mm512_fmadd_ps(xe, we, acc);
#endif
}

INLINE __m512i ld32(const uint16_t *p, int64_t c, int64_t k) {
    if (c + 32 <= k) return _mm512_loadu_si512((const void *)(p + c));
    return _mm512_maskz_loadu_epi16((__mmask32)((1ull << (k - c)) - 1), p + c);
}
#endif

/* Rows [n0, n0 + nr) of W against activation rows [0, m): one block. */
static void block_rows(const uint16_t *x, int64_t xs, int m, int64_t k, const uint16_t *w, int64_t n0, int nr,
                       float *out, int64_t os) {
#if defined(__AVX512F__)
    for (int mi = 0; mi < m; mi += 4) {
        const uint16_t *xr[4];
        for (int a = 0; a < 4; a++) xr[a] = x + (int64_t)(mi + a < m ? mi + a : m - 1) * xs;
        __m512 acc[LB_NB * 4];
        for (int i = 0; i < LB_NB * 4; i++) acc[i] = _mm512_setzero_ps();
        for (int r0 = 0; r0 < LB_NB; r0 += 4) {
            const uint16_t *wr[4];
            for (int b = 0; b < 4; b++) wr[b] = w + (n0 + (r0 + b < nr ? r0 + b : nr - 1)) * k;
            __m512 a[16];
            for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
            const int na = m - mi < 4 ? m - mi : 4;
            for (int64_t c = 0; c < k; c += 32) {
                if (mi == 0) /* the same rows of the next block, a line each per chunk (as qgemv_int8.c) */
                    for (int b = 0; b < 4; b++) _mm_prefetch((const char *)(wr[b] + LB_NB * k + c), _MM_HINT_T0);
                const __m512i w0 = ld32(wr[0], c, k), w1 = ld32(wr[1], c, k);
                const __m512i w2 = ld32(wr[2], c, k), w3 = ld32(wr[3], c, k);
                for (int s = 0; s < na; s++) {
                    const __m512i xv = ld32(xr[s], c, k);
                    a[4 * s + 0] = dot_pairs(a[4 * s + 0], xv, w0);
                    a[4 * s + 1] = dot_pairs(a[4 * s + 1], xv, w1);
                    a[4 * s + 2] = dot_pairs(a[4 * s + 2], xv, w2);
                    a[4 * s + 3] = dot_pairs(a[4 * s + 3], xv, w3);
                }
            }
            /* regroup: acc[16 s + r] = activation row s, weight row r */
            for (int s = 0; s < 4; s++)
                for (int b = 0; b < 4; b++) acc[16 * s + r0 + b] = a[4 * s + b];
        }
        for (int s = 0; s < 4 && mi + s < m; s++) {
            float r[16];
            _mm512_storeu_ps(r, transpose_reduce16(acc + 16 * s));
            for (int i = 0; i < nr; i++) out[(int64_t)(mi + s) * os + n0 + i] = r[i];
        }
    }
#else
    for (int mi = 0; mi < m; mi++)
        for (int i = 0; i < nr; i++) {
            const uint16_t *wr = w + (n0 + i) * k, *xr = x + (int64_t)mi * xs;
            float acc = 0.f;
            for (int64_t c = 0; c < k; c++) acc += bf16_to_f32(xr[c]) * bf16_to_f32(wr[c]);
            out[(int64_t)mi * os + n0 + i] = acc;
        }
#endif
}

/* out fp32 [m][os] = x bf16 [m][xs] @ w bf16 [n][k]^T. */
void logits_bf16(const uint16_t *x, int64_t xs, int32_t m, int32_t k, const uint16_t *w, int64_t n, float *out,
                 int64_t os) {
    const int64_t blocks = (n + LB_NB - 1) / LB_NB;
    /* activation rows per pass: their 4-row groups re-read one weight block from L1/L2 */
#pragma omp parallel for schedule(static) if ((int64_t)m * n * k >= (1 << 15))
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * LB_NB;
        const int nr = (int)(n - n0 < LB_NB ? n - n0 : LB_NB);
        block_rows(x, xs, m, k, w, n0, nr, out, os);
    }
}
