/*
 * bf16 element-wise layers, each one pass instead of several torch ops with fp32 temporaries:
 * RMSNorm, residual-add + RMSNorm, and SiLU(gate) * up.
 *
 * Rounding follows transformers' Llama in bf16: the residual sum is rounded to bf16; the norm
 * is computed in fp32, rounded to bf16, then multiplied by the weight and rounded again;
 * SiLU is rounded to bf16 before the product with `up`.
 */
#include "common.h"
#include "vec8.h"

#if defined(__AVX512F__)
INLINE float row_inv_rms(const uint16_t *x, int n, float eps) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = load16(x, i, 1);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) { const float v = bf16_to_f32(x[i]); ss += v * v; }
    return 1.0f / sqrtf(ss / (float)n + eps);
}

INLINE void norm_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int n, float eps) {
    const float inv = row_inv_rms(x, n, eps);
    const __m512 vi = _mm512_set1_ps(inv);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        store16(out, i, _mm512_mul_ps(load16(w, i, 1), round_bf16(_mm512_mul_ps(load16(x, i, 1), vi))), 1);
    for (; i < n; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * inv)));
}
#elif defined(DUET_AVX2)
INLINE float row_inv_rms(const uint16_t *x, int n, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(x, i, 1);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; i < n; i++) { const float v = bf16_to_f32(x[i]); ss += v * v; }
    return 1.0f / sqrtf(ss / (float)n + eps);
}

INLINE void norm_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int n, float eps) {
    const float inv = row_inv_rms(x, n, eps);
    const __m256 vi = _mm256_set1_ps(inv);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        store8(out, i, _mm256_mul_ps(load8(w, i, 1), vec8_round_bf16(_mm256_mul_ps(load8(x, i, 1), vi))), 1);
    for (; i < n; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * inv)));
}
#else
INLINE void norm_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int n, float eps) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) { const float v = bf16_to_f32(x[i]); ss += v * v; }
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * inv)));
}
#endif

/* out = RMSNorm(x) * w, rows of n. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int32_t rows, int32_t n, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * n >= (1 << 17))
    for (int r = 0; r < rows; r++) norm_row(x + (int64_t)r * n, w, out + (int64_t)r * n, n, eps);
}

/* h += delta (rounded to bf16), then out = RMSNorm(h) * w. */
void add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *w, uint16_t *out, int32_t rows,
                       int32_t n, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * n >= (1 << 17))
    for (int r = 0; r < rows; r++) {
        uint16_t *x = h + (int64_t)r * n;
        const uint16_t *d = delta + (int64_t)r * n;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) store16(x, i, _mm512_add_ps(load16(x, i, 1), load16(d, i, 1)), 1);
#elif defined(DUET_AVX2)
        for (; i + 8 <= n; i += 8) store8(x, i, _mm256_add_ps(load8(x, i, 1), load8(d, i, 1)), 1);
#endif
        for (; i < n; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(d[i]));
        norm_row(x, w, out + (int64_t)r * n, n, eps);
    }
}

/* out[r] = bf16(SiLU(gate[r])) * up[r], with gate_up[r] = [gate (n) | up (n)]. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int32_t rows, int32_t n) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * n >= (1 << 17))
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (int64_t)r * 2 * n, *u = g + n;
        uint16_t *o = out + (int64_t)r * n;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) {
            const __m512 x = load16(g, i, 1);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 s = round_bf16(_mm512_div_ps(x, _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
            store16(o, i, _mm512_mul_ps(s, load16(u, i, 1)), 1);
        }
#elif defined(DUET_AVX2)
        for (; i + 8 <= n; i += 8) {
            const __m256 x = load8(g, i, 1);
            const __m256 e = vec8_exp(_mm256_sub_ps(_mm256_setzero_ps(), x));
            const __m256 s = vec8_round_bf16(_mm256_div_ps(x, _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
            store8(o, i, _mm256_mul_ps(s, load8(u, i, 1)), 1);
        }
#endif
        for (; i < n; i++) {
            const float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(x / (1.0f + expf(-x)))) * bf16_to_f32(u[i]));
        }
    }
}

/* The fp32 residual stream of bf16 engines: h stays fp32 across the layers, so the
 * hidden state's rounding no longer follows the bf16 grid (a near-tie of two logits flipped with
 * it: "What is the capital of France?" answered "L'Étoile…"). h += delta (bf16, skipped when
 * delta is NULL), then out = (h * inv_rms) * w, rounded once to bf16, or stored in fp32 with out_f32
 * (the final norm, which feeds the fp32 logits head). Each row is one thread's sequential work:
 * the result does not depend on the thread count. */
void res_norm_f32(float *h, const uint16_t *delta, const uint16_t *w, void *out, int32_t rows, int32_t n, float eps,
                  int32_t out_f32) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * n >= (1 << 17))
    for (int r = 0; r < rows; r++) {
        float *x = h + (int64_t)r * n;
        const uint16_t *d = delta ? delta + (int64_t)r * n : NULL;
        int i = 0;
        float ss = 0.f;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            if (d) {
                v = _mm512_add_ps(v, load16(d, i, 1));
                _mm512_storeu_ps(x + i, v);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#elif defined(DUET_AVX2)
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            if (d) {
                v = _mm256_add_ps(v, load8(d, i, 1));
                _mm256_storeu_ps(x + i, v);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        ss = hsum8(acc);
#endif
        for (; i < n; i++) {
            if (d) x[i] += bf16_to_f32(d[i]);
            ss += x[i] * x[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        void *o = (char *)out + (int64_t)r * n * (out_f32 ? 4 : 2);
        i = 0;
#if defined(__AVX512F__)
        const __m512 vi = _mm512_set1_ps(inv);
        for (; i + 16 <= n; i += 16)
            store16(o, i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), vi), load16(w, i, 1)), !out_f32);
#elif defined(DUET_AVX2)
        const __m256 vi = _mm256_set1_ps(inv);
        for (; i + 8 <= n; i += 8)
            store8(o, i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi), load8(w, i, 1)), !out_f32);
#endif
        for (; i < n; i++) store_elem(o, i, (x[i] * inv) * bf16_to_f32(w[i]), !out_f32);
    }
}

/* The fp32 engine's norms: h += delta (skipped when delta is NULL), then out = (h * inv_rms) * w,
 * all fp32, as transformers' fp32 RMSNorm (weight * (x * rsqrt(mean(x^2) + eps))) up to the order
 * of the sum of squares. Each row is one thread's sequential work (8 lanes, then the tail), so a
 * row's result does not depend on the rows beside it or the thread count; AVX2 and AVX-512 builds
 * run the same 8-lane code (bitwise alike), the portable C sums in order. */
void add_rms_norm_f32(float *h, const float *delta, const float *w, float *out, int32_t rows, int32_t n, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * n >= (1 << 17))
    for (int r = 0; r < rows; r++) {
        float *x = h + (int64_t)r * n;
        const float *d = delta ? delta + (int64_t)r * n : NULL;
        float *o = out + (int64_t)r * n;
        int i = 0;
        float ss = 0.f;
#if defined(DUET_VEC8)
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            if (d) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(d + i));
                _mm256_storeu_ps(x + i, v);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        ss = hsum8(acc);
#endif
        for (; i < n; i++) {
            if (d) x[i] += d[i];
            ss += x[i] * x[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        i = 0;
#if defined(DUET_VEC8)
        const __m256 vi = _mm256_set1_ps(inv);
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi), _mm256_loadu_ps(w + i)));
#endif
        for (; i < n; i++) o[i] = (x[i] * inv) * w[i];
    }
}

/* out[r] = SiLU(gate[r]) * up[r] in fp32, with gate_up[r] = [gate (n) | up (n)]; SiLU(x) =
 * x / (1 + exp(-x)) as torch computes it (exp within ~2 ulp of torch's: vec8_exp in the vector
 * lanes of AVX2 and AVX-512 builds alike, expf in the tail and the portable C). */
void silu_mul_f32(const float *gate_up, float *out, int32_t rows, int32_t n) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * n >= (1 << 17))
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (int64_t)r * 2 * n, *u = g + n;
        float *o = out + (int64_t)r * n;
        int i = 0;
#if defined(DUET_VEC8)
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = vec8_exp(_mm256_sub_ps(_mm256_setzero_ps(), x));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(e, _mm256_set1_ps(1.0f))),
                                                  _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < n; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}
