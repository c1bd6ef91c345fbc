/*
 * Greedy token selection: the index of the first maximum of each row of logits (fp32 or
 * bf16), as torch.argmax returns it for finite values. One vectorized pass per row, reading
 * bf16 logits directly, so a greedy step needs neither torch's slow row argmax nor an fp32
 * copy of the logits.
 *
 * NaN: a row containing NaN yields the index of its first NaN (torch treats NaN as the max).
 */
#include "common.h"

static int64_t argmax_row(const void *x, int n, int bf16) {
    float m = -INFINITY;
    int has_nan = 0, i = 0;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = load16(x, i, bf16);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(vm, v);
    }
    m = _mm512_reduce_max_ps(vm);
    has_nan = nan != 0;
#elif defined(DUET_AVX2)
    __m256 vm = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(x, i, bf16);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, v);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    has_nan = _mm256_movemask_ps(nan) != 0;
#endif
    for (; i < n; i++) {
        const float v = load_elem(x, i, bf16);
        if (v != v) has_nan = 1;
        else if (v > m) m = v;
    }
    if (has_nan) {
        for (int j = 0; j < n; j++)
            if (isnan(load_elem(x, j, bf16))) return j;
    }
    int j = 0; /* second pass: the first index holding the max */
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(m);
    for (; j + 16 <= n; j += 16) {
        const __mmask16 k = _mm512_cmp_ps_mask(load16(x, j, bf16), target, _CMP_EQ_OQ);
        if (k) return j + __builtin_ctz(k);
    }
#elif defined(DUET_AVX2)
    const __m256 target = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
        const int k = _mm256_movemask_ps(_mm256_cmp_ps(load8(x, j, bf16), target, _CMP_EQ_OQ));
        if (k) return j + __builtin_ctz((unsigned)k);
    }
#endif
    for (; j < n; j++)
        if (load_elem(x, j, bf16) == m) return j;
    return 0;
}

/* The x86 level this library was built for (its kernels' paths follow it): 0 portable C, 1 AVX2 +
 * FMA (Haswell, Zen 1-3), 2 AVX-512 F/BW/VL, 3 with AVX-512 BF16, 4 with AMX. A build's level,
 * not the process's: AMX's tile permission is asked at run time (logits_bf16_isa, qgemm_bf16_isa). */
int32_t kernels_isa(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return 4;
#elif defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return 3;
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* out[r] = argmax of row r (rows of n, row_stride elements apart). */
void argmax_rows(const void *x, int64_t row_stride, int32_t rows, int32_t n, int32_t bf16, int64_t *out) {
    const int64_t esz = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if ((int64_t)rows * n >= (1 << 18))
    for (int r = 0; r < rows; r++) out[r] = argmax_row((const char *)x + esz * r * row_stride, n, bf16);
}
