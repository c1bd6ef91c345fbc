/*
 * bf16 linear layers on the project's own GEMM: out = x @ W^T (+ bias), bf16 x and W, fp32
 * accumulation, one rounding at the store (bf16, or fp32 with out_f32).
 *
 * W is packed once (linear_bf16_pack) into qgemm_bf16.h's panel layout: blocks of 32 rows (n
 * rounded up to 32, the extra rows zero), each two 16-row halves of uint32 [kp / 2][16] with pair
 * p (k = 2 p, 2 p + 1) of row r at [16 p + r] (k padded to 32 with zeros). qb_gemm reads the
 * panels where they lie, for every m: AMX tdpbf16ps where the CPU has it, else vdpbf16ps.
 *
 * Why one path for every m: each output element's sum runs over k in an order fixed by k alone
 * (AMX: QB_KB passes of 32-k tile products; vdpbf16ps: one chain over the pairs), so a row's
 * result does not depend on the rows computed beside it. Single-stream decode, a decode batch,
 * a speculative verification and a prefill compute a token's activations bitwise alike
 * (tests/engine/test_linear_bf16.py). oneDNN's bf16 kernels, which this replaces where it
 * applies (engine/linear.py), pick their blocking by m, and on AVX-512 BF16 CPUs their rows
 * differ with m (stop 33: bf16 speculation was not greedy-identical on Zen 4 / Zen 5).
 * Speed (SmolLM2's shapes, 2 threads, AMX; oneDNN's prepacked weights as the baseline):
 * 1.3-2x at 1-32 rows, 0.8-1.3x at 512 (tests never time it; bench.engine_tiers measures it).
 *
 * On CPUs with AVX-512 BF16 but no AMX (Zen 4/5) the vdpbf16ps path, against oneDNN's own
 * AVX-512 BF16 kernels: 1.2-2.0x at one row, 0.9-2.7x at 2-8, 0.8-1.6x at 16-128, a 512-token
 * prefill's four linears 0.98-1.01x together (Zen 4, 2 threads). On an AMX CPU the AMX path runs (the vdpbf16ps
 * one is 0.1-0.6x oneDNN's AMX there).
 *
 * Built for AVX-512 BF16 (and AMX) as above, and for AVX2 + FMA, where the bf16 words are
 * widened to fp32 in registers: a few-row kernel up to LB_PANEL_MIN_ROWS rows, the fp32 panel
 * GEMM from there (measured on Zen 3: the panel loses below ~96 rows). Elsewhere
 * qgemm_bf16_isa() says 0 and engine/linear.py keeps oneDNN's prepacked weights, or F.linear.
 */
#include "qgemm_bf16.h"

/* uint32 words of the packed form of an n x k matrix. */
int64_t linear_bf16_packed_words(int64_t n, int32_t k) { return (n + 31) / 32 * 32 * (qb_pad32(k) / 2); }


/* Packs w bf16 [n][k] into out (linear_bf16_packed_words(n, k) words, 64-byte aligned). Returns
 * 0, or -3 where this build has neither AVX-512 BF16 nor AVX2. */
int32_t linear_bf16_pack(const uint16_t *w, int64_t n, int32_t k, uint32_t *out) {
    const int64_t halves = (n + 31) / 32 * 2, words = 16 * (qb_pad32(k) / 2);
#if defined(QB_BF16)
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < halves; b++) /* half b: rows 16 b .. 16 b + 15 */
        pack_pairs16(w + 16 * b * (int64_t)k, k, (int)(n - 16 * b < 0 ? 0 : n - 16 * b), k, out + b * words);
    return 0;
#elif defined(DUET_AVX2)
    /* the same layout, once at load: word [16 p + r] of half b = row 16 b + r's inputs 2p (low
     * half) and 2p + 1 (high), zero past k and past n */
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < halves; b++)
        for (int64_t p = 0; p < words / 16; p++)
            for (int r = 0; r < 16; r++) {
                const int64_t row = 16 * b + r, k0 = 2 * p;
                const uint32_t lo = row < n && k0 < k ? w[row * k + k0] : 0, hi = row < n && k0 + 1 < k ? w[row * k + k0 + 1] : 0;
                out[b * words + 16 * p + r] = lo | hi << 16;
            }
    return 0;
#else
    (void)w, (void)n, (void)k, (void)out, (void)halves, (void)words;
    return -3;
#endif
}

/* Activation rows from which linear_bf16's AVX2 path takes the fp32 panel GEMM (qgemm_f32.h)
 * rather than lb_avx2_few; the two give the same bits, so this is speed alone. The panel GEMM
 * writes each half as an fp32 panel (twice the bf16 words' bytes) and reads it back per 6 rows,
 * where lb_avx2_few widens the words in registers per 5 rows: SmolLM2's bf16 linears, one Zen 3
 * thread, the two alternated in one process (CPU time, load 5-6): the panel takes 1.11-1.37x the
 * time at 16-48 rows, 1.07x at 64, 1.00x at 96-128, 0.96x at 256, 0.94x at 512. */
#define LB_PANEL_MIN_ROWS 96

/* 1 where m activation rows take the panel GEMM on this build's AVX2 path, 0 where they take
 * lb_avx2_few, -3 where the build has no AVX2 path (AVX-512 BF16 runs qb_gemm for every m). */
int32_t linear_bf16_avx2_panel(int32_t m) {
#if defined(DUET_AVX2)
    return m >= LB_PANEL_MIN_ROWS;
#else
    (void)m;
    return -3;
#endif
}

#if defined(DUET_AVX2)
/* Rows n0 .. n0 + 16 (a half of a packed block) as qgemm_f32.h's fp32 panel: pair p's word
 * widens to input 2p + 1 (its high half: row 2p) and 2p (its low half, shifted up: row 2p + 1). */
static void panel_bf16(const void *ctx, int64_t n0, int nr, float *panel, int64_t kp) {
    const uint32_t *half = (const uint32_t *)ctx + (n0 / 16) * 8 * kp;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t p = 0; p < kp / 2; p++)
        for (int h = 0; h < 16; h += 8) {
            const __m256i wv = _mm256_load_si256((const __m256i *)(half + 16 * p + h));
            _mm256_store_ps(panel + 32 * p + h, _mm256_castsi256_ps(_mm256_and_si256(wv, hi)));
            _mm256_store_ps(panel + 32 * p + 16 + h, _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)));
        }
    (void)nr;
}

/* R activation rows (R <= 5, a constant at each call) of X (fp32, pair-swapped, rows kp apart)
 * against one packed half (16 weight rows): each pair's word split into its two bf16 in registers
 * (no panel), then qf_rows' two FMAs a row in its order (input 2p + 1, then 2p), so the same bits
 * as the panel path. acc [R][16]. pf: the next half, a line per pair (NULL: none). */
static inline __attribute__((always_inline)) void lb_pair_rows(const float *X, int64_t kp, const uint32_t *half,
                                                                 float *acc, const int R, const char *pf) {
    __m256 a[5][2];
    for (int s = 0; s < R; s++) a[s][0] = a[s][1] = _mm256_setzero_ps();
    const __m256i hm = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t p = 0; p < kp / 2; p++) {
        if (pf) _mm_prefetch(pf + 64 * p, _MM_HINT_T0);
        const __m256i w0 = _mm256_load_si256((const __m256i *)(half + 16 * p));
        const __m256i w1 = _mm256_load_si256((const __m256i *)(half + 16 * p + 8));
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, hm)), o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, hm));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
        for (int s = 0; s < R; s++) {
            const __m256 xo = _mm256_broadcast_ss(X + s * kp + 2 * p), xe = _mm256_broadcast_ss(X + s * kp + 2 * p + 1);
            a[s][0] = _mm256_fmadd_ps(xe, e0, _mm256_fmadd_ps(xo, o0, a[s][0]));
            a[s][1] = _mm256_fmadd_ps(xe, e1, _mm256_fmadd_ps(xo, o1, a[s][1]));
        }
    }
    for (int s = 0; s < R; s++) {
        _mm256_storeu_ps(acc + 16 * s, a[s][0]);
        _mm256_storeu_ps(acc + 16 * s + 8, a[s][1]);
    }
}

/* linear_bf16 below LB_PANEL_MIN_ROWS rows on AVX2: lb_pair_rows over every half, 5 rows at a time. */
static int32_t lb_avx2_few(const void *x, int64_t xs, int xbf16, int m, int k, const uint32_t *panels, int64_t n,
                           const void *bias, void *out, int64_t os, int obf16) {
    const int64_t kp = qb_pad32(k), halves = (n + 15) / 16, hw = 8 * kp, esz = obf16 ? 2 : 4;
    float *X = qf_x(x, xs, m, k, xbf16, kp);
    if (!X) return -1;
#pragma omp parallel for schedule(static) if ((int64_t)m * n * k >= (1 << 15))
    for (int64_t b = 0; b < halves; b++) {
        const int64_t n0 = 16 * b;
        const int nr = (int)(n - n0 < 16 ? n - n0 : 16);
        /* the next half, fetched during the first pass (qb_gemm's pf_next reason) */
        const char *pf = b + 1 < halves ? (const char *)(panels + (b + 1) * hw) : NULL;
        float acc[5 * 16];
        for (int m0 = 0; m0 < m; m0 += 5) {
            const int R = m - m0 < 5 ? m - m0 : 5;
            const float *Xs = X + (int64_t)m0 * kp;
            const char *p = m0 == 0 ? pf : NULL;
            switch (R) { /* a constant count each */
            case 1: lb_pair_rows(Xs, kp, panels + b * hw, acc, 1, p); break;
            case 2: lb_pair_rows(Xs, kp, panels + b * hw, acc, 2, p); break;
            case 3: lb_pair_rows(Xs, kp, panels + b * hw, acc, 3, p); break;
            case 4: lb_pair_rows(Xs, kp, panels + b * hw, acc, 4, p); break;
            default: lb_pair_rows(Xs, kp, panels + b * hw, acc, 5, p); break;
            }
            for (int s = 0; s < R; s++)
                qf_store(acc + 16 * s, nr, n0, NULL, bias, xbf16, (char *)out + (int64_t)(m0 + s) * os * esz, obf16);
        }
    }
    free(X);
    return 0;
}

/* out [m][os] = x @ W^T + bias on AVX2, x bf16 (xbf16) or fp32, bias in x's dtype, out bf16 or fp32. */
static int32_t lb_avx2(const void *x, int64_t xs, int xbf16, int m, int k, const uint32_t *panels, int64_t n,
                       const void *bias, void *out, int64_t os, int obf16) {
    if (!linear_bf16_avx2_panel(m)) return lb_avx2_few(x, xs, xbf16, m, k, panels, n, bias, out, os, obf16);
    return qf_gemm(x, xs, xbf16, m, k, n, panels, panel_bf16, NULL, bias, out, os, obf16);
}
#endif

/* out [m][os] (bf16, or fp32 with out_f32) = x bf16 [m][xs] @ W^T + bias (bf16 [n] or NULL), W
 * packed by linear_bf16_pack. isa: 0 the best available, else 1 / 2 (tests). Returns 0, -1 when
 * out of memory, -3 when the path is not available in this build or process. */
int32_t linear_bf16(const uint16_t *x, int64_t xs, int32_t m, int32_t k, const uint32_t *panels, int64_t n,
                    const uint16_t *bias, void *out, int64_t os, int32_t out_f32, int32_t isa) {
    isa = qb_isa_pick(isa);
    if (isa < 1) return -3;
#if defined(QB_BF16)
    return qb_gemm(x, xs, m, k, n, panels, NULL, NULL, bias, out, os, out_f32, isa);
#elif defined(DUET_AVX2)
    return lb_avx2(x, xs, 1, m, k, panels, n, bias, out, os, !out_f32);
#else
    (void)x, (void)xs, (void)m, (void)k, (void)panels, (void)n, (void)bias, (void)out, (void)os, (void)out_f32;
    return -3;
#endif
}

/* linear_bf16 for fp32 x (fp32 bias and out) on AVX2, where a bf16 weight meets fp32 activations
 * (CPUs without bf16 arithmetic). Returns 0, -1 when out of memory, -3 where this build has no
 * AVX2 path. */
int32_t linear_bf16_xf32(const float *x, int64_t xs, int32_t m, int32_t k, const uint32_t *panels, int64_t n,
                         const float *bias, float *out, int64_t os) {
#if defined(DUET_AVX2)
    return lb_avx2(x, xs, 0, m, k, panels, n, bias, out, os, 0);
#else
    (void)x, (void)xs, (void)m, (void)k, (void)panels, (void)n, (void)bias, (void)out, (void)os;
    return -3;
#endif
}
