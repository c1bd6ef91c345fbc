/*
 * The logits GEMM in bf16 with fp32 output: out fp32 [m][os] = x bf16 [m][xs] @ W bf16 [n][k]^T.
 *
 * Why: a bf16 lm_head that rounds its output to bf16 ties tokens whose fp32 logits differ (issue
 * 25: "The" and "L" both -1.8766 for "What is the capital of France?"); vLLM's sampler takes fp32
 * logits. Every product of two bf16 values is exact in fp32, so with fp32 accumulation the only
 * rounding left is the accumulation's own.
 *
 * Paths (logits_bf16_isa; each computes a row's logits the same whatever m is, so a sequence's
 * logits do not depend on the batch it decodes in or on a speculative verification's k + 1 rows):
 * - AMX (2), where the CPU has amx_bf16: the weight rows are the A tiles, read where they lie (16
 *   rows x 32 k), the activation rows the B tiles (packed once a call), C [16 weight rows][16
 *   activation rows] stored transposed. Every m takes it: 32 rows (a decode batch of 16 in hi/lo
 *   halves, engine/logits_head.py) 34.6 -> 4.0 ms on SmolLM2's 49,152 x 576 head at 2 threads,
 *   6 rows 5.7 -> 2.0 ms; one row 1.5 -> 1.8 ms (the price of one path for every m). A block that
 *   is not 32 whole rows of 32-k chunks is staged, zero-padded.
 * - AVX-512 (1): 16 weight rows per block, 4 at a time with their accumulators in registers, every
 *   activation row against them with a 4x4 register block; lane l accumulates k = 32 c + 2 l,
 *   2 l + 1 (vdpbf16ps pairs; with avx512f alone, the same pair order with two FMAs) in chunk
 *   order, then transpose_reduce16 sums the lanes. k's tail is zero-masked. The first activation
 *   pass over a block prefetches the same rows of the next block, a line per chunk, to L2 (1-row
 *   logits 3.7 -> 2.6 ms; the rows are too short for the hardware prefetcher; to L2 rather than L1,
 *   where the lines were evicted before use: 0.61-0.76x the time for the logits of 1-6 sequences,
 *   0.86x at 16, 0.91x at 32, Zen 4, bench.kernel_ab --head). One or two activation rows
 *   (a decode step) run 16 or 8 weight rows at once instead (block_rows_few: the same sums); more
 *   rows go 4 at a time with their count a constant (block_rows_4_m: 1.2-1.3x at 3-6 rows, 1.6x at
 *   12 — a speculative verification's k + 1 = 6 rows in hi/lo halves — 2.1-2.3x at 32-64).
 * - AVX2 (3, CPUs without AVX-512): the AVX-512 blocks' chains as 8-lane halves (dot_pairs' two
 *   FMAs, transpose_reduce16_avx2), one or two activation rows against 4 or 2 weight rows at a
 *   time: the AVX-512 path's bits.
 * - portable C (0).
 * The paths differ from each other only in the order of their fp32 sums.
 */
#include <stdlib.h>
#include <string.h>

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

#if defined(__AVX512F__)
/* block_rows for one or two activation rows (`rows`, a constant at each call): all 16 weight rows
 * at once for one row, 8 for two (their accumulators fill the registers), instead of 4, so more
 * lines are in flight a chunk. A decode step's logits are one fp32 row as two bf16 halves (m = 2,
 * engine/logits_head.py); one bf16 row is m = 1. SmolLM2's 49,152 x 576 head at 2 threads, Zen 4,
 * against block_rows: one row 3.0-3.4 -> 2.3-2.6 ms, two rows 1.16-1.25x. Each row's sums are the
 * same operations in the same order as block_rows', so a row's logits still do not depend on m. */
INLINE void block_rows_few_m(const uint16_t *x, int64_t xs, const int rows, int64_t k, const uint16_t *w,
                             int64_t n0, int nr, float *out, int64_t os) {
    const int nb = rows == 1 ? 16 : 8; /* weight rows per pass */
    __m512 acc[LB_NB * 2];
    for (int r0 = 0; r0 < LB_NB; r0 += nb) {
        const uint16_t *wr[16];
        for (int b = 0; b < nb; b++) wr[b] = w + (n0 + (r0 + b < nr ? r0 + b : nr - 1)) * k;
        __m512 a[2][16];
        for (int b = 0; b < nb; b++) a[0][b] = a[1][b] = _mm512_setzero_ps();
        for (int64_t c = 0; c < k; c += 32) {
            const __m512i x0 = ld32(x, c, k), x1 = rows > 1 ? ld32(x + xs, c, k) : x0;
            for (int b = 0; b < nb; b++) {
                _mm_prefetch((const char *)(wr[b] + LB_NB * k + c), _MM_HINT_T1); /* the next block */
                const __m512i wv = ld32(wr[b], c, k);
                a[0][b] = dot_pairs(a[0][b], x0, wv);
                if (rows > 1) a[1][b] = dot_pairs(a[1][b], x1, wv);
            }
        }
        for (int s = 0; s < rows; s++)
            for (int b = 0; b < nb; b++) acc[LB_NB * s + r0 + b] = a[s][b];
    }
    for (int s = 0; s < rows; s++) {
        float r[16];
        _mm512_storeu_ps(r, transpose_reduce16(acc + LB_NB * s));
        for (int i = 0; i < nr; i++) out[(int64_t)s * os + n0 + i] = r[i];
    }
}

static void block_rows_few(const uint16_t *x, int64_t xs, int m, int64_t k, const uint16_t *w, int64_t n0, int nr,
                           float *out, int64_t os) {
    if (m == 1) block_rows_few_m(x, xs, 1, k, w, n0, nr, out, os);
    else block_rows_few_m(x, xs, 2, k, w, n0, nr, out, os);
}
#endif

#if defined(__AVX512F__)
/* Up to four activation rows (`na`, a constant at each call, so the 4 x 4 register block of
 * accumulators stays in registers: sized at run time it was an array in memory, ~3 cycles a
 * vdpbf16ps) against the block's 16 weight rows, 4 at a time; `prefetch` (the first group of a
 * block) touches the same rows of the next block, a line each per chunk (as qgemv_int8.c). */
INLINE void block_rows_4_m(const uint16_t *const xr[4], const int na, int64_t k, const uint16_t *w, int64_t n0,
                           int nr, float *out, int64_t os, int prefetch) {
    __m512 acc[LB_NB * 4];
    for (int r0 = 0; r0 < LB_NB; r0 += 4) {
        const uint16_t *wr[4];
        for (int b = 0; b < 4; b++) wr[b] = w + (n0 + (r0 + b < nr ? r0 + b : nr - 1)) * k;
        __m512 a[16];
        for (int i = 0; i < 4 * na; i++) a[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < k; c += 32) {
            if (prefetch)
                for (int b = 0; b < 4; b++) _mm_prefetch((const char *)(wr[b] + LB_NB * k + c), _MM_HINT_T1);
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
        for (int s = 0; s < na; s++)
            for (int b = 0; b < 4; b++) acc[16 * s + r0 + b] = a[4 * s + b];
    }
    for (int s = 0; s < na; s++) {
        float r[16];
        _mm512_storeu_ps(r, transpose_reduce16(acc + 16 * s));
        for (int i = 0; i < nr; i++) out[(int64_t)s * os + n0 + i] = r[i];
    }
}
#endif

#if defined(DUET_AVX2)
/* One half (8 pairs: inputs 16 h .. 16 h + 15 of a chunk) of a 32-input chunk of bf16 row p from
 * input c, split into its odd (high bf16) and even inputs as fp32; past k zero. */
INLINE void lb_half(const uint16_t *p, int64_t c, int64_t k, __m256 *odd, __m256 *even) {
    __m256i v;
    if (c + 16 <= k) {
        v = _mm256_loadu_si256((const __m256i *)(p + c));
    } else {
        uint16_t t[16] = {0};
        if (c < k) memcpy(t, p + c, sizeof(uint16_t) * (size_t)(k - c));
        v = _mm256_loadu_si256((const __m256i *)t);
    }
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* Activation rows xr[0 .. NA) against weight rows wr[0 .. NW) (constants: NA NW <= 4), every
 * (activation, weight) pair the AVX-512 loops' 16 lane chains as halves: lane l takes pair l of
 * each 32-input chunk, odd product then even (dot_pairs' order), chunk after chunk. lo/hi [NA][NW].
 * prefetch: the same rows of the next block, a line each per chunk, to L2 (the AVX-512 reason). */
static inline __attribute__((always_inline)) void lb_dots_avx2(const uint16_t *const *xr, const int NA,
                                                                 const uint16_t *const *wr, const int NW, int64_t k,
                                                                 __m256 (*lo)[4], __m256 (*hi)[4], int prefetch) {
    __m256 al[2][4], ah[2][4];
    for (int s = 0; s < NA; s++)
        for (int j = 0; j < NW; j++) al[s][j] = ah[s][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; c += 32)
        for (int h = 0; h < 32; h += 16) {
            __m256 xo[2], xe[2];
            for (int s = 0; s < NA; s++) lb_half(xr[s], c + h, k, &xo[s], &xe[s]);
            for (int j = 0; j < NW; j++) {
                if (prefetch && h == 0) _mm_prefetch((const char *)(wr[j] + LB_NB * k + c), _MM_HINT_T1);
                __m256 wo, we;
                lb_half(wr[j], c + h, k, &wo, &we);
                for (int s = 0; s < NA; s++) {
                    if (h) ah[s][j] = _mm256_fmadd_ps(xe[s], we, _mm256_fmadd_ps(xo[s], wo, ah[s][j]));
                    else al[s][j] = _mm256_fmadd_ps(xe[s], we, _mm256_fmadd_ps(xo[s], wo, al[s][j]));
                }
            }
        }
    for (int s = 0; s < NA; s++)
        for (int j = 0; j < NW; j++) lo[s][j] = al[s][j], hi[s][j] = ah[s][j];
}

/* block_rows on AVX2: one activation row against 4 weight rows at a time, or two against 2 (the
 * accumulators of AVX-512's groupings do not fit 16 registers; the chains, and so the bits, are the
 * same), then transpose_reduce16's sums. */
static void block_rows_avx2(const uint16_t *x, int64_t xs, int m, int64_t k, const uint16_t *w, int64_t n0, int nr,
                            float *out, int64_t os) {
    for (int m0 = 0; m0 < m; m0 += 2) {
        const int na = m - m0 < 2 ? m - m0 : 2;
        const uint16_t *xr[2] = {x + (int64_t)m0 * xs, x + (int64_t)(m0 + na - 1) * xs};
        __m256 lo[2][16], hi[2][16];
        const int nw = na == 1 ? 4 : 2;
        for (int r0 = 0; r0 < LB_NB; r0 += nw) {
            const uint16_t *wr[4];
            for (int j = 0; j < nw; j++) wr[j] = w + (n0 + (r0 + j < nr ? r0 + j : nr - 1)) * k;
            __m256 bl[2][4], bh[2][4];
            if (na == 1) lb_dots_avx2(xr, 1, wr, 4, k, bl, bh, m0 == 0);
            else lb_dots_avx2(xr, 2, wr, 2, k, bl, bh, m0 == 0);
            for (int s = 0; s < na; s++)
                for (int j = 0; j < nw; j++) lo[s][r0 + j] = bl[s][j], hi[s][r0 + j] = bh[s][j];
        }
        for (int s = 0; s < na; s++) {
            float r[16];
            transpose_reduce16_avx2(lo[s], hi[s], r);
            for (int i = 0; i < nr; i++) out[(int64_t)(m0 + s) * os + n0 + i] = r[i];
        }
    }
}
#endif

/* Rows [n0, n0 + nr) of W against activation rows [0, m): one block. */
static void block_rows(const uint16_t *x, int64_t xs, int m, int64_t k, const uint16_t *w, int64_t n0, int nr,
                       float *out, int64_t os) {
#if defined(__AVX512F__)
    if (m <= 2) {
        block_rows_few(x, xs, m, k, w, n0, nr, out, os);
        return;
    }
    for (int mi = 0; mi < m; mi += 4) {
        const uint16_t *xr[4];
        for (int a = 0; a < 4; a++) xr[a] = x + (int64_t)(mi + a < m ? mi + a : m - 1) * xs;
        const int na = m - mi < 4 ? m - mi : 4;
        float *o = out + (int64_t)mi * os;
        switch (na) { /* a constant row count each (CONST_ROWS_SWITCH's reason; it goes to 7) */
        case 1: block_rows_4_m(xr, 1, k, w, n0, nr, o, os, mi == 0); break;
        case 2: block_rows_4_m(xr, 2, k, w, n0, nr, o, os, mi == 0); break;
        case 3: block_rows_4_m(xr, 3, k, w, n0, nr, o, os, mi == 0); break;
        default: block_rows_4_m(xr, 4, k, w, n0, nr, o, os, mi == 0); break;
        }
    }
#elif defined(DUET_AVX2)
    block_rows_avx2(x, xs, m, k, w, n0, nr, out, os);
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

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BW__)
#define LB_AMX 1
/* Weight rows [n0, n0 + nr) (nr <= 32; w points at row n0, rows wstride elements apart, 32 rows
 * and chunks * 32 k readable) against every activation row: two A tiles of 16 weight rows as they
 * lie in memory, the B tiles lb_amx packs (pack_pairs16), C = [16 weight rows][16 activation rows], stored
 * transposed into out. */
static void lb_amx_block(const uint16_t *w, int64_t wstride, int64_t chunks, const uint32_t *bt, int groups, int m,
                         int64_t n0, int nr, float *out, int64_t os, int prefetch) {
    float cbuf[4][256] __attribute__((aligned(64)));
    for (int g = 0; g < groups; g += 2) {
        const int two = g + 1 < groups;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < chunks; c++) {
            if (prefetch && g == 0) /* the next block's 32 rows at this chunk, a line each */
                for (int r = 0; r < 32; r++) _mm_prefetch((const char *)(w + (32 + r) * wstride + 32 * c), _MM_HINT_T0);
            _tile_loadd(4, w + 32 * c, wstride * 2);
            _tile_loadd(5, w + 16 * wstride + 32 * c, wstride * 2);
            _tile_loadd(6, bt + (g * chunks + c) * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            if (two) {
                _tile_loadd(7, bt + ((g + 1) * chunks + c) * 256, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(1, cbuf[1], 64);
        _tile_stored(2, cbuf[2], 64);
        _tile_stored(3, cbuf[3], 64);
        for (int t = 0; t < (two ? 4 : 2); t++) {
            const int h = t & 1, gg = g + (t >> 1), rows = nr - 16 * h, acts = m - 16 * gg;
            if (rows <= 0 || acts <= 0) continue;
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512((const void *)(cbuf[t] + 16 * i));
            transpose16(r); /* r[j]: activation row j's 16 outputs */
            const __mmask16 mk = (__mmask16)(rows >= 16 ? 0xffff : (1u << rows) - 1);
            for (int j = 0; j < 16 && j < acts; j++)
                _mm512_mask_storeu_ps(out + (int64_t)(16 * gg + j) * os + n0 + 16 * h, mk, _mm512_castsi512_ps(r[j]));
        }
    }
}

/* The AMX path of logits_bf16 (every m: a row's logits do not depend on the rows beside it).
 * Returns 0, -1 when out of memory. */
static int lb_amx(const uint16_t *x, int64_t xs, int m, int64_t k, const uint16_t *w, int64_t n, float *out,
                  int64_t os) {
    const int groups = (m + 15) / 16;
    const int64_t chunks = (k + 31) / 32, kp = 32 * chunks, blocks = (n + 31) / 32;
    uint32_t *bt = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * 256 * (size_t)(groups * chunks));
    if (!bt) return -1;
    /* every 32-k chunk c of activation rows [16 g, 16 g + 16) as one B tile at bt + (g chunks + c) 256 */
    for (int g = 0; g < groups; g++) pack_pairs16(x + 16 * g * xs, xs, m - 16 * g, k, bt + g * chunks * 256);
    int fail = 0;
#pragma omp parallel if ((int64_t)m * n * k >= (1 << 15))
    {
        /* a block that is not whole (k not a multiple of 32, or the last rows of w) is copied into
         * a zero-padded buffer first: a tile load reads 32 rows of 64 bytes */
        uint16_t *stage = (k % 32 || n % 32) ? (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 32 * (size_t)kp) : NULL;
        if ((k % 32 || n % 32) && !stage) {
#pragma omp atomic write
            fail = 1;
        }
        amx_configure_16x64();
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = 32 * b;
            const int nr = (int)(n - n0 < 32 ? n - n0 : 32);
            if (nr == 32 && k % 32 == 0) {
                lb_amx_block(w + n0 * k, k, chunks, bt, groups, m, n0, nr, out, os, n0 + 64 <= n);
            } else if (stage) {
                memset(stage, 0, sizeof(uint16_t) * 32 * (size_t)kp);
                for (int r = 0; r < nr; r++) memcpy(stage + r * kp, w + (n0 + r) * k, sizeof(uint16_t) * (size_t)k);
                lb_amx_block(stage, kp, chunks, bt, groups, m, n0, nr, out, os, 0);
            }
        }
        _tile_release();
        free(stage);
    }
    free(bt);
    return fail ? -1 : 0;
}
#endif

/* Which path logits_bf16 runs here: 2 AMX, 1 the AVX-512 blocks, 3 their AVX2 halves, 0 portable C. */
int32_t logits_bf16_isa(void) {
#if defined(LB_AMX)
    if (amx_permitted()) return 2;
#endif
#if defined(__AVX512F__)
    return 1;
#elif defined(DUET_AVX2)
    return 3;
#else
    return 0;
#endif
}

/* out fp32 [m][os] = x bf16 [m][xs] @ w bf16 [n][k]^T on path `isa` (logits_bf16_isa's values; 0:
 * the best here). Returns 0, -1 when out of memory, -3 for a path this build or CPU lacks. Each
 * path computes a row's logits the same whatever m is; the paths differ from each other in the
 * order of their fp32 sums only. */
int32_t logits_bf16_path(const uint16_t *x, int64_t xs, int32_t m, int32_t k, const uint16_t *w, int64_t n,
                         float *out, int64_t os, int32_t isa) {
    const int have = logits_bf16_isa();
    if (isa == 0) isa = have;
    if (have == 3 ? isa != 3 : isa > have || (have >= 1 && isa < 1)) return -3;
#if defined(LB_AMX)
    if (isa == 2) return lb_amx(x, xs, m, k, w, n, out, os);
#endif
    const int64_t blocks = (n + LB_NB - 1) / LB_NB;
    /* activation rows per pass: their 4-row groups re-read one weight block from L1/L2 */
#pragma omp parallel for schedule(static) if ((int64_t)m * n * k >= (1 << 15))
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * LB_NB;
        const int nr = (int)(n - n0 < LB_NB ? n - n0 : LB_NB);
        block_rows(x, xs, m, k, w, n0, nr, out, os);
    }
    return 0;
}

/* out fp32 [m][os] = x bf16 [m][xs] @ w bf16 [n][k]^T, on the best path here. Returns 0, -1 when out of memory. */
int32_t logits_bf16(const uint16_t *x, int64_t xs, int32_t m, int32_t k, const uint16_t *w, int64_t n, float *out,
                    int64_t os) {
    return logits_bf16_path(x, xs, m, k, w, n, out, os, 0);
}
