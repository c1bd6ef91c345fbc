/*
 * The bf16 GEMM path of the weight-only quantized linears (qgemv_int8.c, qgemv_int4.c), for
 * bf16 activations with many rows (prefill, batched decode):
 * out[m, n] = sum_k x[m, k] * bf16(W[n, k]) (* scale[n]) (+ bias[n]), fp32 accumulation, one
 * rounding at the store. Activations are NOT quantized (that is the W8A8 schemes' job).
 *
 * Each thread takes 32 output rows of W at a time, dequantizes them once into a bf16 panel in
 * the VNNI pair layout (uint32 [k/2 pairs][16 rows] per half: pair p of row r at [16 p + r],
 * i.e. one AMX B tile per 32 k, one vdpbf16ps operand per pair), then runs every activation row
 * against it:
 * - AMX (tdpbf16ps, 2x2 16x16 fp32 tiles) where the CPU has amx_bf16 and the OS grants the tile
 *   state (asked once at run time);
 * - AVX-512 BF16 (vdpbf16ps: a broadcast activation pair times a weight pair row), e.g. Zen 4;
 * - neither (the build has no avx512_bf16): qgemm_bf16_isa() says 0 and the callers keep the
 *   fp32 tile path (qgemm.h).
 * The cost is the bf16 GEMM plus one O(n k) dequantization per call, amortized over m; the
 * panel stays in L1/L2, so no dequantized copy of the matrix ever exists.
 *
 * The values multiplied: int8 q exactly (|q| <= 127 fits bf16's 8-bit significand; the per-row
 * scale is applied in fp32 in the epilogue, as on the fp32 path), int4 fma(d, q, m) rounded to
 * bf16 (nearest even). Sums are in fp32, in another order than the fp32 path's, so the two
 * agree within bf16 tolerance, not bitwise.
 */
#ifndef DUET_KERNELS_QGEMM_BF16_H
#define DUET_KERNELS_QGEMM_BF16_H

#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QB_BF16 1
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define QB_AMX 1
#endif
#endif

INLINE int64_t qb_pad32(int64_t k) { return (k + 31) & ~(int64_t)31; }

#include "qgemm_f32.h"

/* Which GEMM path this build and process can run: 2 AMX, 1 AVX-512 BF16, 3 AVX2's fp32 panels
 * (qgemm_f32.h: bf16 or fp32 activations), 0 none. */
static int qb_isa(void) {
#if defined(QB_AMX)
    return amx_permitted() ? 2 : 1;
#elif defined(QB_BF16)
    return 1;
#elif defined(DUET_AVX2)
    return 3;
#else
    return 0;
#endif
}

/* The path an entry point asked for isa (0: the best here) runs, or -1 when this build or process
 * lacks it (an AMX build can run the AVX-512 BF16 path too). */
static int qb_isa_pick(int isa) {
    const int have = qb_isa();
    if (isa == 0 || isa == have) return have;
    return have == 2 && isa == 1 ? 1 : -1;
}

#if defined(QB_BF16)
/*
 * Writes rows n0 .. n0 + nr (nr <= 16) of W, dequantized to bf16, into panel [kp / 2][16]
 * (pairs of consecutive k as one uint32); rows nr .. 15 and k beyond the matrix are zero.
 */
typedef void (*qb_dequant_fn)(const void *ctx, int64_t n0, int nr, uint32_t *panel, int64_t kp);

/* Two rows of 16 fp32 (k 0..15 and 16..31 of a chunk) as 32 bf16 = 16 pairs, in k order. */
INLINE __m512i qb_pairs(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

/* Outputs n0 .. n0 + cnt (cnt <= 16) of one row from 16 fp32 sums: scale, bias, one rounding. */
INLINE void qb_store16(const float *acc, int cnt, int64_t n0, const float *scale, const void *bias, void *out_row,
                       int out_f32) {
    const __mmask16 mk = (__mmask16)(cnt >= 16 ? 0xffff : (1u << cnt) - 1);
    __m512 v = _mm512_loadu_ps(acc);
    if (scale) v = _mm512_mul_ps(v, cnt == 16 ? _mm512_loadu_ps(scale + n0) : _mm512_maskz_loadu_ps(mk, scale + n0));
    if (bias) {
        const __m256i b = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)bias + n0);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    if (cnt == 16) {
        if (out_f32) _mm512_storeu_ps((float *)out_row + n0, v);
        else _mm256_storeu_si256((__m256i *)((uint16_t *)out_row + n0), (__m256i)_mm512_cvtneps_pbh(v));
    } else if (out_f32) {
        _mm512_mask_storeu_ps((float *)out_row + n0, mk, v);
    } else {
        _mm256_mask_storeu_epi16((uint16_t *)out_row + n0, mk, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* A whole block's 32 outputs [n0, n0 + 32) of `rows` rows (acc [rows][32]) as bf16, each row one
 * 64-byte store: qb_store16's arithmetic with the block's scales and bias loaded once;
 * non-temporal with `nt` (common.h: NT_OUTPUT_BYTES). */
static void qb_store_rows32(const float *acc, int rows, int64_t n0, const float *scale, const void *bias, char *out,
                            int64_t orow, int nt) {
    const __m512 s0 = scale ? _mm512_loadu_ps(scale + n0) : _mm512_set1_ps(1.0f);
    const __m512 s1 = scale ? _mm512_loadu_ps(scale + n0 + 16) : s0;
    __m512 b0 = _mm512_setzero_ps(), b1 = b0;
    if (bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)bias + n0))), 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)bias + n0 + 16))), 16));
    }
    for (int s = 0; s < rows; s++) {
        __m512 v0 = _mm512_loadu_ps(acc + 32 * s), v1 = _mm512_loadu_ps(acc + 32 * s + 16);
        if (scale) v0 = _mm512_mul_ps(v0, s0), v1 = _mm512_mul_ps(v1, s1);
        if (bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
        store64((uint16_t *)(out + (int64_t)s * orow) + n0, (__m512i)_mm512_cvtne2ps_pbh(v1, v0), nt);
    }
}

#if defined(QB_AMX)

/* acc [32][32] (row stride 32) += X rows mi .. mi + 32 (or 16 when !two) times the two panel
 * halves over k in [k0, k1); acc is loaded first unless `fresh`. */
static void qb_amx_tile(const uint16_t *X, int64_t kp, int two, const uint32_t *p0, const uint32_t *p1, int64_t k0,
                        int64_t k1, float *acc, int fresh) {
    if (fresh) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, acc, 128);
        _tile_loadd(1, acc + 16, 128);
        if (two) {
            _tile_loadd(2, acc + 16 * 32, 128);
            _tile_loadd(3, acc + 16 * 32 + 16, 128);
        }
    }
    for (int64_t c = k0; c < k1; c += 32) {
        _tile_loadd(6, p0 + c * 8, 64);
        _tile_loadd(7, p1 + c * 8, 64);
        _tile_loadd(4, X + c, kp * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, X + 16 * kp + c, kp * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
    if (two) {
        _tile_stored(2, acc + 16 * 32, 128);
        _tile_stored(3, acc + 16 * 32 + 16, 128);
    }
}
#endif

#define QB_MR 8 /* activation rows per vdpbf16ps pass */
/* ... except the last pass of a call, which takes up to 10 (20 accumulators, the two panel vectors
 * and the broadcast still fit the 32 registers): a 9-row call — a k = 8 speculative verification —
 * was 8 rows and then a second pass over every panel for one row (SmolLM2's 30 layers of linears,
 * 2 threads, Zen 4: 10.5 ms at 8 rows, 11.7 at 9). 10-row passes throughout measured slower for
 * prefills (0.97x at 512 rows), so only the tail takes them. */
#define QB_MR_TAIL 10

/* acc [rows][32] = X rows against the two panel halves, with vdpbf16ps.
 * `rows` (<= QB_MR_TAIL) is a constant at every call (qb_dp_tile's switch), so a decode step's single row costs 2
 * vdpbf16ps a pair, not 16 (1.6-2.4x faster at one row on Zen 4). Each
 * output's chain over the pairs runs in k order whatever `rows` is. */
static inline __attribute__((always_inline)) void qb_dp_rows(const uint16_t *X, int64_t kp, const uint32_t *p0,
                                                               const uint32_t *p1, float *acc, const int rows,
                                                               const uint32_t *pf) {
    __m512 a[QB_MR_TAIL][2];
    for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp / 2; p++) {
        if (pf) {
            _mm_prefetch((const char *)(pf + 16 * p), _MM_HINT_T1);
            _mm_prefetch((const char *)(pf + 8 * kp + 16 * p), _MM_HINT_T1);
        }
        const __m512bh b0 = (__m512bh)_mm512_load_si512((const void *)(p0 + 16 * p));
        const __m512bh b1 = (__m512bh)_mm512_load_si512((const void *)(p1 + 16 * p));
        for (int r = 0; r < rows; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(X + r * kp + 2 * p));
            a[r][0] = _mm512_dpbf16_ps(a[r][0], xv, b0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], xv, b1);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(acc + 32 * r, a[r][0]);
        _mm512_storeu_ps(acc + 32 * r + 16, a[r][1]);
    }
}

static void qb_dp_tile(const uint16_t *X, int64_t kp, const uint32_t *p0, const uint32_t *p1, float *acc, int rows,
                       const uint32_t *pf) {
    /* pf is a constant NULL in the copies without prefetching: tested in the inner loop, it made
     * 512-row prefills ~4 % slower */
#define QB_DP_ROWS(r) qb_dp_rows(X, kp, p0, p1, acc, r, PF)
#define QB_DP_SWITCH                                                                                \
    switch (rows) { /* CONST_ROWS_SWITCH's reason; that macro stops at 7 */                       \
    case 9: QB_DP_ROWS(9); break;                                                                   \
    case 10: QB_DP_ROWS(10); break;                                                                 \
    default: CONST_ROWS_SWITCH(rows, QB_MR, QB_DP_ROWS)                                             \
    }
    if (pf) {
#define PF pf
        QB_DP_SWITCH
#undef PF
    } else {
#define PF NULL
        QB_DP_SWITCH
#undef PF
    }
#undef QB_DP_SWITCH
#undef QB_DP_ROWS
}

/* Activation rows per pass over a super-panel: their bf16 copy and the pass's outputs stay in L2
 * (a whole prefill's outputs, written 64 bytes per row per block, would thrash it). */
#define QB_MC 128
/* Blocks of 32 weight rows per super-panel at most: 8 x 32 rows x k bf16 (<= 768 KiB at k = 1536) */
#define QB_SB 8
/* k per AMX pass: a block's 32 x QB_KB bf16 (16 KiB) stays in L1 while the pass's activation rows
 * run against it (their sums kept in acc between passes), so only the activations stream from L2 */
#define QB_KB 256
/* calls of fewer rows prefetch the next block of panels read in place (qb_gemm) */
#define QB_PF_ROWS 64

/*
 * Driver: out [m][os] = x [m][xs] (bf16) @ dequant(W)^T (* scale) (+ bias, bf16), out bf16 or
 * fp32 (out_f32). isa: 2 AMX, 1 AVX-512 BF16 (must be <= qb_isa()). Each thread dequantizes a
 * super-panel of up to QB_SB blocks once, then runs the activations over it QB_MC rows at a
 * time. With dequant NULL, ctx is the whole matrix already in panel form (linear_bf16.c: blocks
 * of 32 rows, n rounded up to 32) and the super-panels are read where they lie. Every output
 * element's sum runs over k in the same order whatever m is (AMX: QB_KB passes of tdpbf16ps;
 * vdpbf16ps: one chain over the pairs), so a row's result does not depend on the rows beside
 * it. Returns 0, -1 when out of memory.
 */
static int32_t qb_gemm(const uint16_t *x, int64_t xs, int m, int k, int64_t n, const void *ctx, qb_dequant_fn dequant,
                       const float *scale, const void *bias, void *out, int64_t os, int out_f32, int isa) {
    const int64_t kp = qb_pad32(k), blocks = (n + 31) / 32, esz = out_f32 ? 4 : 2, bsz = kp * 16; /* uint32 per block */
    const int mpad = (m + 15) & ~15;
    const int64_t passes = (kp + QB_KB - 1) / QB_KB, kb = qb_pad32((kp + passes - 1) / passes); /* even passes */
    uint16_t *X = (uint16_t *)aligned_alloc(64, (size_t)(mpad * kp * 2 + 64));
    if (!X) return -1;
    for (int r = 0; r < mpad; r++) {
        uint16_t *dst = X + (int64_t)r * kp;
        if (r < m) {
            memcpy(dst, x + r * xs, (size_t)k * 2);
            memset(dst + k, 0, (size_t)(kp - k) * 2);
        } else {
            memset(dst, 0, (size_t)kp * 2);
        }
    }
    const int par = (int64_t)m * n * k >= (1 << 15);
    const int nt = (int64_t)m * n * esz > NT_OUTPUT_BYTES; /* qb_store_rows32 */
    int threads = 1;
#if defined(_OPENMP)
    if (par) threads = omp_get_max_threads();
#endif
    /* super-panels: at least one per thread, a multiple of the thread count, each <= QB_SB blocks */
    int64_t sps = (blocks + QB_SB - 1) / QB_SB;
    sps = sps < threads ? threads : sps;
    sps = (sps + threads - 1) / threads * threads;
    const int64_t sb = (blocks + sps - 1) / sps;
    sps = (blocks + sb - 1) / sb;
    int fail = 0;
#pragma omp parallel if (par)
    {
        uint32_t *panel = dequant ? (uint32_t *)aligned_alloc(64, (size_t)(sb * bsz * 4)) : NULL;
        const int have_panel = panel || !dequant;
        float *acc = (float *)aligned_alloc(64, sizeof(float) * QB_MC * 32); /* [QB_MC][32] */
        if (!have_panel || !acc) {
#pragma omp atomic write
            fail = 1;
        }
#if defined(QB_AMX)
        if (isa == 2 && have_panel && acc) amx_configure_16x64();
#endif
#pragma omp for schedule(static)
        for (int64_t sp = 0; sp < sps; sp++) {
            if (!have_panel || !acc) continue;
            const int64_t b0 = sp * sb, nb = blocks - b0 < sb ? blocks - b0 : sb;
            const uint32_t *sp_panel = dequant ? panel : (const uint32_t *)ctx + b0 * bsz;
            for (int64_t b = 0; dequant && b < nb; b++) { /* two halves of 16 rows per block */
                for (int h = 0; h < 2; h++) {
                    const int64_t r0 = 32 * (b0 + b) + 16 * h;
                    uint32_t *dst = panel + b * bsz + h * 8 * kp;
                    if (r0 < n) dequant(ctx, r0, (int)(n - r0 < 16 ? n - r0 : 16), dst, kp);
                    else memset(dst, 0, (size_t)(kp * 32));
                }
            }
            for (int m0 = 0; m0 < m; m0 += QB_MC) {
                const int m1 = m - m0 < QB_MC ? m : m0 + QB_MC;
                for (int64_t b = 0; b < nb; b++) {
                    const int64_t n0 = 32 * (b0 + b);
                    const uint32_t *p0 = sp_panel + b * bsz, *p1 = p0 + 8 * kp;
                    /* Read in place, a block's first pass brings the next one to L2: with few rows
                     * the passes are too short to hide its misses (bench.kernel_ab, SmolLM2's 120
                     * linears, Zen 4, 2 threads: 0.98x the time at 1 row, 0.78x at 8, 0.90x at 32,
                     * 1.00x at 64; more rows hide them, so not there) */
                    const int pf_next = !dequant && m < QB_PF_ROWS && m0 == 0 && b0 + b + 1 < blocks;
                    const int nr0 = (int)(n - n0 < 16 ? n - n0 : 16), nr1 = (int)(n - n0 - 16 < 16 ? n - n0 - 16 : 16);
#if defined(QB_AMX)
                    if (isa == 2)
                        for (int64_t k0 = 0; k0 < kp; k0 += kb)
                            for (int mi = m0; mi < m1; mi += 32)
                                qb_amx_tile(X + (int64_t)mi * kp, kp, mi + 16 < mpad, p0, p1, k0,
                                            kp - k0 < kb ? kp : k0 + kb, acc + (mi - m0) * 32, k0 == 0);
                    else
#endif
                        /* one chain over all of k: splitting k into L1-sized passes (as AMX does)
                         * measured 3-7 % slower on Zen 4 (the fp32 sums' reload costs more than the
                         * panel's L2 reads) */
                        for (int mi = m0, r; mi < m1; mi += r) {
                            r = m1 - mi <= QB_MR_TAIL ? m1 - mi : QB_MR;
                            qb_dp_tile(X + (int64_t)mi * kp, kp, p0, p1, acc + (mi - m0) * 32, r,
                                       mi == m0 && pf_next ? p0 + bsz : NULL);
                        }
                    if (nr1 == 16 && !out_f32) {
                        qb_store_rows32(acc, m1 - m0, n0, scale, bias, (char *)out + (int64_t)m0 * os * esz, os * esz, nt);
                        continue;
                    }
                    for (int s = m0; s < m1; s++) {
                        char *row = (char *)out + (int64_t)s * os * esz;
                        qb_store16(acc + 32 * (s - m0), nr0, n0, scale, bias, row, out_f32);
                        if (nr1 > 0) qb_store16(acc + 32 * (s - m0) + 16, nr1, n0 + 16, scale, bias, row, out_f32);
                    }
                }
            }
        }
#if defined(QB_AMX)
        if (isa == 2 && have_panel && acc) _tile_release();
#endif
        if (nt) _mm_sfence(); /* non-temporal stores are weakly ordered: visible before the caller reads */
        free(panel);
        free(acc);
    }
    free(X);
    return fail ? -1 : 0;
}
#endif /* QB_BF16 */

#endif
