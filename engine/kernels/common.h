/*
 * Helpers shared by the CPU kernels: bf16 <-> fp32, AVX-512 building blocks (a fast exp, a 16x16
 * transpose-reduce), and the AMX tile permission and configuration. Everything is static (inline);
 * each .c file includes this once.
 *
 * Invariants: bf16 stores round to nearest even (as torch does) and keep NaNs NaN; exp512 is
 * accurate to ~2 ulp for x <= 0 (softmax inputs after the max is subtracted).
 */
#ifndef DUET_KERNELS_COMMON_H
#define DUET_KERNELS_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__AMX_TILE__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* `switch (rows)` calling CALL(r) with r the compile-time constant 1 .. 7 that equals `rows`, else
 * CALL(MAX). An always_inline body sized by a constant row count keeps its per-row accumulators
 * in registers; sized at run time they are an array in memory (13-16 % of the grouped W8A8 path,
 * 1.6-2.4x at one row in the bf16 tile). A caller that never passes some counts says so with
 * __builtin_unreachable() before it, and those cases are not instantiated. */
#define CONST_ROWS_SWITCH(rows, MAX, CALL)                                                          \
    switch (rows) {                                                                                 \
    case 1: CALL(1); break;                                                                         \
    case 2: CALL(2); break;                                                                         \
    case 3: CALL(3); break;                                                                         \
    case 4: CALL(4); break;                                                                         \
    case 5: CALL(5); break;                                                                         \
    case 6: CALL(6); break;                                                                         \
    case 7: CALL(7); break;                                                                         \
    default: CALL(MAX); break;                                                                      \
    }

/* Output bytes from which the GEMMs store whole 64-byte lines non-temporally: past L2, a line
 * written now is evicted before anyone reads it, and a non-temporal store skips reading it in
 * first (512 x 3072 bf16, W8A8: ~1.5x the speed of the whole GEMM, one thread; slower when the
 * output fits in cache). A kernel that stores so calls _mm_sfence() before it returns. */
#define NT_OUTPUT_BYTES ((int64_t)2 << 20)

#if defined(__AMX_TILE__)
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Whether this process may use AMX tiles: Linux grants the tile state per process through
 * arch_prctl (asked once per translation unit; every caller computes the same answer, so the
 * race is harmless). */
static inline int amx_permitted(void) {
    static volatile int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* This thread's tile configuration: all eight tiles 16 rows x 64 bytes (every AMX kernel here
 * uses that shape; a smaller operand is zero-padded instead). */
INLINE void amx_configure_16x64(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
#endif

INLINE float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}

INLINE uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of a bf16 (bf16 != 0) or fp32 array, as fp32. */
INLINE float load_elem(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store_elem(void *p, int64_t i, float f, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(f);
    else ((float *)p)[i] = f;
}

#if defined(__AVX512F__)
/* 16 consecutive elements as fp32. */
INLINE __m512 load16(const void *p, int64_t i, int bf16) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}

/* 16 fp32 rounded to bf16 (nearest even, NaN stays NaN). */
INLINE __m256i cvt16_bf16(__m512 x) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

/* Round 16 fp32 to bf16 and store them (or store fp32 as is). */
INLINE void store16(void *p, int64_t i, __m512 x, int bf16) {
    if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), cvt16_bf16(x));
    else _mm512_storeu_ps((float *)p + i, x);
}

/* x rounded to bf16 precision, kept as fp32. */
INLINE __m512 round_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt16_bf16(x)), 16));
}

/* exp(x), x <= 88 (below -87 it returns exp(-87)): Cephes-style range reduction and a degree-6
 * polynomial, scaled by 2^n. */
INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* In place: r[c] becomes column c of the 16x16 dword matrix whose rows were r[0..16) (the K tiles of
 * attention, the bf16 GEMM's weight panels). */
INLINE void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) {
        u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    /* u[4k + m], 128-bit lane L: rows 4k..4k+3 of column 4L + m */
    for (int m = 0; m < 4; m++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
        r[m] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        r[8 + m] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}

#if defined(__AVX512BW__)
/* Rows [0, 16) of src (rows `stride` elements apart; rows from `rows` on read as zero) as the VNNI
 * pair layout of AMX / vdpbf16ps operands: for every 32-k chunk c (k padded to 32 with zeros),
 * uint32 [16 pairs][16 rows] at dst + 256 c, pair p (k = 32 c + 2 p, + 1) of row r at [16 p + r].
 * One 16x16 transpose of uint32 per chunk. */
INLINE void pack_pairs16(const uint16_t *src, int64_t stride, int rows, int64_t k, uint32_t *dst) {
    for (int64_t c0 = 0; c0 < k; c0 += 32) {
        const __mmask32 mk = k - c0 >= 32 ? 0xffffffffu : (1u << (k - c0)) - 1; /* k past the row: 0 */
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = i < rows ? _mm512_maskz_loadu_epi16(mk, src + i * stride + c0) : _mm512_setzero_si512();
        transpose16(r);
        for (int p = 0; p < 16; p++) _mm512_storeu_si512((void *)(dst + 8 * c0 + 16 * p), r[p]);
    }
}
#endif

/* 64 bytes at dst (NT_OUTPUT_BYTES): non-temporal when `nt` and dst is 64-byte aligned, else a plain store. */
INLINE void store64(void *dst, __m512i v, int nt) {
    if (nt && ((uintptr_t)dst & 63) == 0) _mm512_stream_si512(dst, v);
    else _mm512_storeu_si512(dst, v);
}

/* out[i] = sum of the 16 lanes of v[i]: one vector of 16 dot products without 16 horizontal
 * reductions (~3 shuffles + adds per input instead of ~8). */
INLINE __m512 transpose_reduce16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; k++)
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int k = 0; k < 2; k++)
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#if !defined(__AVX512F__)
/* The AVX2 + FMA paths run where the build has AVX2 and no AVX-512 (Haswell+, Zen 1-3): an AVX-512
 * build keeps its own paths, unchanged. Where an AVX2 path mirrors an AVX-512 one, a 16-lane
 * vector is two 8-lane halves (lanes 0-7, 8-15) carrying the same operations in the same order,
 * so the two give the same bits. */
#define DUET_AVX2 1
#endif

/* 8 consecutive elements as fp32. */
INLINE __m256 load8(const void *p, int64_t i, int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

/* 8 fp32 rounded to bf16 (nearest even, NaN stays NaN): f32_to_bf16 on each lane. */
INLINE __m128i cvt8_bf16(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* Round 8 fp32 to bf16 and store them (or store fp32 as is). */
INLINE void store8(void *p, int64_t i, __m256 x, int bf16) {
    if (bf16) _mm_storeu_si128((__m128i *)((uint16_t *)p + i), cvt8_bf16(x));
    else _mm256_storeu_ps((float *)p + i, x);
}

/* The sum of 8 lanes (a fixed tree). */
INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* transpose_reduce16 on 16-lane vectors held as halves (v[i] = lo[i] | hi[i]): out[i] = the sum of
 * v[i]'s 16 lanes, by the AVX-512 function's own adds in its order (its unpacks act within
 * 128-bit lanes, the same on a half; its cross-lane shuffles become vperm2f128), so the same bits. */
INLINE void transpose_reduce16_avx2(const __m256 *lo, const __m256 *hi, float *out) {
    __m256 tl[8], th[8], ul[4], uh[4], wl[2], wh[2];
    for (int k = 0; k < 8; k++) {
        tl[k] = _mm256_add_ps(_mm256_unpacklo_ps(lo[2 * k], lo[2 * k + 1]), _mm256_unpackhi_ps(lo[2 * k], lo[2 * k + 1]));
        th[k] = _mm256_add_ps(_mm256_unpacklo_ps(hi[2 * k], hi[2 * k + 1]), _mm256_unpackhi_ps(hi[2 * k], hi[2 * k + 1]));
    }
    for (int k = 0; k < 4; k++) {
        const __m256d al = _mm256_castps_pd(tl[2 * k]), bl = _mm256_castps_pd(tl[2 * k + 1]);
        const __m256d ah = _mm256_castps_pd(th[2 * k]), bh = _mm256_castps_pd(th[2 * k + 1]);
        ul[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(al, bl)), _mm256_castpd_ps(_mm256_unpackhi_pd(al, bl)));
        uh[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ah, bh)), _mm256_castpd_ps(_mm256_unpackhi_pd(ah, bh)));
    }
    /* w[k] = [a.L0 + a.L1, a.L2 + a.L3, b.L0 + b.L1, b.L2 + b.L3], a = u[2k], b = u[2k + 1] */
    for (int k = 0; k < 2; k++) {
        wl[k] = _mm256_add_ps(_mm256_permute2f128_ps(ul[2 * k], uh[2 * k], 0x20), _mm256_permute2f128_ps(ul[2 * k], uh[2 * k], 0x31));
        wh[k] = _mm256_add_ps(_mm256_permute2f128_ps(ul[2 * k + 1], uh[2 * k + 1], 0x20),
                              _mm256_permute2f128_ps(ul[2 * k + 1], uh[2 * k + 1], 0x31));
    }
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(wl[0], wh[0], 0x20), _mm256_permute2f128_ps(wl[0], wh[0], 0x31)));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_permute2f128_ps(wl[1], wh[1], 0x20), _mm256_permute2f128_ps(wl[1], wh[1], 0x31)));
}
#endif

#endif
