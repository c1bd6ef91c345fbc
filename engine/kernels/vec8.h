/*
 * AVX2 + FMA building blocks of the attention, rope and norm kernels (CPUs without AVX-512:
 * Zen 2/3, Intel client parts): 8 fp32 lanes, bf16 widened to fp32 in registers (these CPUs have
 * no bf16 arithmetic) and rounded back to bf16 as torch rounds.
 *
 * Invariants: vec8_exp is exp512's arithmetic lane for lane (same range reduction,
 * polynomial and FMAs; 2^n applied as an exact product instead of scalef), so a kernel using it
 * rounds as the AVX-512 one does wherever their sums are taken in the same order.
 * The loads, stores and bf16 rounding are common.h's (load8, store8, cvt8_bf16, hsum8). Static
 * inline; included by the kernel sources after common.h.
 */
#ifndef DUET_KERNELS_VEC8_H
#define DUET_KERNELS_VEC8_H

#include "common.h"

/* DUET_VEC8: these helpers exist (any AVX2 + FMA build, AVX-512 ones included); DUET_AVX2
 * (common.h): the kernels take their AVX2 paths. */
#if defined(__AVX2__) && defined(__FMA__)
#define DUET_VEC8 1

/* Lanes [0, n) of all-ones (a maskload/maskstore mask), 0 <= n <= 8. */
INLINE __m256i vec8_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 16 consecutive bf16 as fp32 in two vectors: elements 0, 2, .., 14 (`even`) and 1, 3, .., 15 (`odd`):
 * a shift and a mask of one load, no lane crossing. Sums over the elements (dot products) take
 * them in this order; a vector result is put back in order by vec8_interleave. */
INLINE void vec8_load_pairs(const uint16_t *p, __m256 *even, __m256 *odd) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000u)));
}

/* The inverse of vec8_load_pairs' split: elements 0..7 to *lo, 8..15 to *hi. */
INLINE void vec8_interleave(__m256 even, __m256 odd, __m256 *lo, __m256 *hi) {
    const __m256 a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);
    *lo = _mm256_permute2f128_ps(a, b, 0x20);
    *hi = _mm256_permute2f128_ps(a, b, 0x31);
}

/* x rounded to bf16 precision, kept as fp32. */
INLINE __m256 vec8_round_bf16(__m256 x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(cvt8_bf16(x)), 16));
}

/* vec8_round_bf16 for finite x (the softmax weights: exps in [0, 1], never NaN since vec8_exp
 * clamps its argument): the same round to nearest even in four integer ops, without the NaN
 * blend and the pack and widen back. */
INLINE __m256 vec8_round_bf16_finite(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

INLINE float vec8_hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x), x <= 88 (below -87 it returns exp(-87)): exp512's range reduction and polynomial. */
INLINE __m256 vec8_exp(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n, n in [-126, 127]: a normal power of two, so the product rounds as scalef does */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#endif
