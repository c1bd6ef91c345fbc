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
 * Built only where the CPU has AVX-512 BF16 (qgemm_bf16_isa() says 0 elsewhere, and engine/linear.py
 * keeps oneDNN's prepacked weights, or F.linear).
 */
#include "qgemm_bf16.h"

/* uint32 words of the packed form of an n x k matrix. */
int64_t linear_bf16_packed_words(int64_t n, int32_t k) { return (n + 31) / 32 * 32 * (qb_pad32(k) / 2); }


/* Packs w bf16 [n][k] into out (linear_bf16_packed_words(n, k) words, 64-byte aligned). Returns
 * 0, or -3 where this build has no AVX-512 BF16. */
int32_t linear_bf16_pack(const uint16_t *w, int64_t n, int32_t k, uint32_t *out) {
#if defined(QB_BF16)
    const int64_t halves = (n + 31) / 32 * 2, words = 16 * (qb_pad32(k) / 2);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < halves; b++) /* half b: rows 16 b .. 16 b + 15 */
        pack_pairs16(w + 16 * b * (int64_t)k, k, (int)(n - 16 * b < 0 ? 0 : n - 16 * b), k, out + b * words);
    return 0;
#else
    (void)w, (void)n, (void)k, (void)out;
    return -3;
#endif
}

/* out [m][os] (bf16, or fp32 with out_f32) = x bf16 [m][xs] @ W^T + bias (bf16 [n] or NULL), W
 * packed by linear_bf16_pack. isa: 0 the best available, else 1 / 2 (tests). Returns 0, -1 when
 * out of memory, -3 when the path is not available in this build or process. */
int32_t linear_bf16(const uint16_t *x, int64_t xs, int32_t m, int32_t k, const uint32_t *panels, int64_t n,
                    const uint16_t *bias, void *out, int64_t os, int32_t out_f32, int32_t isa) {
    const int have = qb_isa();
    if (isa == 0) isa = have;
    if (isa < 1 || isa > have) return -3;
#if defined(QB_BF16)
    return qb_gemm(x, xs, m, k, n, panels, NULL, NULL, bias, out, os, out_f32, isa);
#else
    (void)x, (void)xs, (void)m, (void)k, (void)panels, (void)n, (void)bias, (void)out, (void)os, (void)out_f32;
    return -3;
#endif
}
