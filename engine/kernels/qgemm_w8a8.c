/*
 * W8A8 linear: out[m, n] = ((float)sum_k xq[m, k] * q[n, k] * sx[m]) * sw[n] (+ bias[n]).
 *
 * Activations are quantized per token, dynamically: sx = amax|x_m| / 127, xq = rne(x * (127 /
 * amax)) in [-127, 127], in fp32 arithmetic (torch reproduces it bit for bit). Weights are int8
 * with an fp32 scale per output row, packed once at load (engine/quant.py::pack_w8a8) in the
 * VNNI/AMX block layout: blocks of 16 output rows (N padded to 32), each a run of k/4 "quads" of
 * 64 bytes, quad r holding q[n][4r .. 4r+3] for the block's 16 rows n in turn. One layout serves
 * every path: a 64-byte load is a vpdpbusd operand (16 outputs in 16 lanes, no reduction) and 16
 * quads are one AMX B tile.
 *
 * Sums accumulate in int32 (exact), so every path gives the same bits whatever the batch:
 * - AMX (tdpbusd on 16x16 int32 tiles, 2x2 tiles per pass) for m >= 16 on CPUs with amx_int8
 *   whose OS grants the tile state (asked once at run time; otherwise the next path runs); each
 *   32 x 32 block's epilogue overlaps the next block's tile products (w8_amx_rows);
 * - AVX-512 VNNI (vpdpbusd: a broadcast activation quad times a weight quad), and AVX-512BW
 *   without VNNI (vpmaddwd on widened bytes): 8 activation rows per pass over a weight block (with
 *   VNNI, an ungrouped linear's full 8-row tiles take both blocks of a pair per pass);
 * - portable C.
 * vpdpbusd multiplies unsigned by signed bytes, so the VNNI and portable paths store activations
 * as xq + 128 and subtract 128 * sum_k q[n, k] (wsum, precomputed); AMX's tdpbssd multiplies
 * signed by signed, so its activations are stored as xq and nothing is subtracted. The epilogue dequantizes 16 outputs at
 * a time: ((float)(acc - 128 wsum) * sx) * sw, plus the bias, one rounding at the store.
 *
 * Activation groups (`group` > 0, a multiple of 64): each row's activations get one scale per
 * `group` inputs instead of one per row, for a linear whose inputs hold outliers a per-token scale
 * cannot share (SmolLM2's down projection, engine/quant.py::ACT_GROUPS). Each group's int32 sums
 * are dequantized on their own and added in fp32, in group order: tot = sum_g (float)(acc_g -
 * 128 wsum_g) * sx_g (tot starts at 0), out = tot * sw (+ bias). wsum is then [groups][n]. With
 * one group this is the ungrouped formula bit for bit (0 + a == a), so one group takes the
 * ungrouped epilogue. On AMX the group loop is innermost per 32 rows x 32 outputs: a group's tiles
 * go through a 4 KiB L1 buffer, and their dequantization runs beside the next group's tdpbssd
 * (w8_amx_grouped). -ffp-contract=off (engine/kernels/__init__.py) keeps every product and sum
 * rounded as torch's reference rounds it.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define W8_AMX 1
#endif

#define W8_MR 8       /* activation rows per VNNI pass */
/* Calls of fewer rows fetch the next pair of blocks to L2 during their first pass over a pair: a
 * pass of 8 rows is too short to hide the misses of weights streamed from memory (qgemm_bf16.h's
 * QB_PF_ROWS, measured the same way) */
#define W8_PF_ROWS 64
#define W8_AMX_MB 128 /* activation rows per AMX pass over the weights (a multiple of 32) */
#if defined(DUET_AVX2)
#define W8_SIGNED 1 /* the dots take signed activations (w8_dots_mr's AVX2 path) */
#else
#define W8_SIGNED 0
#endif

INLINE int64_t w8_pad64(int64_t k) { return (k + 63) & ~(int64_t)63; }

/* Quantize k activations x into bytes dst: xq + off (off 128: unsigned, for vpdpbusd; 0: signed,
 * for AMX's tdpbssd); returns sx = amax / 127. */
static float w8_quant_span(const void *x, int64_t k, int bf16, int off, uint8_t *dst) {
    float amax = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x, i, bf16)));
    amax = _mm512_reduce_max_ps(vmax);
#elif defined(DUET_AVX2)
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(load8(x, i, bf16), absmask));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
    for (; i < k; i++) {
        const float a = fabsf(load_elem(x, i, bf16));
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;
    i = 0;
#if defined(__AVX512F__)
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), voff = _mm512_set1_epi32(off);
    for (; i + 16 <= k; i += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, i, bf16), vinv)); /* round to nearest even */
        q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), voff);
        _mm_storeu_si128((__m128i *)(dst + i), _mm512_cvtepi32_epi8(q));
    }
#elif defined(DUET_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (; i + 8 <= k; i += 8) {
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, i, bf16), vinv)); /* round to nearest even */
        q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
        const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(dst + i), _mm_add_epi8(_mm_packs_epi16(q16, q16), _mm_set1_epi8((char)off)));
    }
#endif
    for (; i < k; i++) {
        float q = nearbyintf(load_elem(x, i, bf16) * inv);
        q = q < -127.f ? -127.f : (q > 127.f ? 127.f : q);
        dst[i] = (uint8_t)((int)q + off);
    }
    return amax / 127.0f;
}

/* Quantize activation row x (k elements) into bytes xq + off (padded to kp with off, a zero):
 * one scale per `g` inputs (g: a multiple of 64, or kp for one scale per row), written to
 * sx[0 .. groups). */
static void w8_quant_row(const void *x, int64_t k, int64_t kp, int64_t g, int bf16, int off, uint8_t *dst, float *sx) {
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t g0 = 0, j = 0; g0 < k; g0 += g, j++)
        sx[j] = w8_quant_span((const char *)x + g0 * esz, (k - g0 < g ? k - g0 : g), bf16, off, dst + g0);
    memset(dst + k, off, (size_t)(kp - k));
}

/* Dequantize acc [cnt <= 16] (outputs n0 ..) of one activation row into out_row. wsum NULL: the
 * sums are of signed activations (AMX), no offset to take back. */
INLINE void w8_epilogue(const int32_t *acc, int cnt, float sx, const float *scale, const int32_t *wsum,
                        const void *bias, int64_t n0, void *out_row, int bf16) {
    int i = 0;
#if defined(__AVX512F__)
    if (cnt == 16) {
        __m512i a = _mm512_loadu_si512((const void *)acc);
        if (wsum) a = _mm512_sub_epi32(a, _mm512_slli_epi32(_mm512_loadu_si512((const void *)(wsum + n0)), 7));
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(sx)), _mm512_loadu_ps(scale + n0));
        if (bias) v = _mm512_add_ps(v, load16(bias, n0, bf16));
        store16(out_row, n0, v, bf16);
        return;
    }
#elif defined(DUET_AVX2)
    if (cnt == 16) {
        for (int h = 0; h < 16; h += 8) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(acc + h));
            if (wsum) a = _mm256_sub_epi32(a, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(wsum + n0 + h)), 7));
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(sx)), _mm256_loadu_ps(scale + n0 + h));
            if (bias) v = _mm256_add_ps(v, load8(bias, n0 + h, bf16));
            store8(out_row, n0 + h, v, bf16);
        }
        return;
    }
#endif
    for (; i < cnt; i++) {
        float v = ((float)(acc[i] - (wsum ? 128 * wsum[n0 + i] : 0)) * sx) * scale[n0 + i];
        if (bias) v += load_elem(bias, n0 + i, bf16);
        store_elem(out_row, n0 + i, v, bf16);
    }
}

/* One activation group's sums of one row into its fp32 total: tot[i] += (float)(acc[i] - 128
 * wsum_g[n0 + i]) * sx_g (cnt <= 16; wsum_g NULL: signed sums, as in w8_epilogue). */
INLINE void w8_group_add(const int32_t *acc, int cnt, float sx, const int32_t *wsum_g, int64_t n0, float *tot) {
    int i = 0;
#if defined(__AVX512F__)
    if (cnt == 16) {
        __m512i a = _mm512_loadu_si512((const void *)acc);
        if (wsum_g) a = _mm512_sub_epi32(a, _mm512_slli_epi32(_mm512_loadu_si512((const void *)(wsum_g + n0)), 7));
        _mm512_storeu_ps(tot, _mm512_add_ps(_mm512_loadu_ps(tot), _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(sx))));
        return;
    }
#elif defined(DUET_AVX2)
    if (cnt == 16) {
        for (int h = 0; h < 16; h += 8) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(acc + h));
            if (wsum_g) a = _mm256_sub_epi32(a, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(wsum_g + n0 + h)), 7));
            _mm256_storeu_ps(tot + h, _mm256_add_ps(_mm256_loadu_ps(tot + h), _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(sx))));
        }
        return;
    }
#endif
    for (; i < cnt; i++) tot[i] += (float)(acc[i] - (wsum_g ? 128 * wsum_g[n0 + i] : 0)) * sx;
}

/* A grouped row's totals tot [cnt <= 16] times the weight scales (+ bias) into out_row. */
INLINE void w8_group_store(const float *tot, int cnt, const float *scale, const void *bias, int64_t n0, void *out_row,
                           int bf16) {
    int i = 0;
#if defined(__AVX512F__)
    if (cnt == 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(tot), _mm512_loadu_ps(scale + n0));
        if (bias) v = _mm512_add_ps(v, load16(bias, n0, bf16));
        store16(out_row, n0, v, bf16);
        return;
    }
#elif defined(DUET_AVX2)
    if (cnt == 16) {
        for (int h = 0; h < 16; h += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(tot + h), _mm256_loadu_ps(scale + n0 + h));
            if (bias) v = _mm256_add_ps(v, load8(bias, n0 + h, bf16));
            store8(out_row, n0 + h, v, bf16);
        }
        return;
    }
#endif
    for (; i < cnt; i++) {
        float v = tot[i] * scale[n0 + i];
        if (bias) v += load_elem(bias, n0 + i, bf16);
        store_elem(out_row, n0 + i, v, bf16);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(__AVX512VNNI__)
/* vpdpbusd without VNNI: u8 x s8 products summed in pairs (vpmaddwd), then the pairs of pairs. */
__attribute__((unused)) static inline __m512i w8_dot_bw(__m512i acc, __m512i x, __m512i w) {
    const __m512i lo8 = _mm512_set1_epi16(0x00ff);
    const __m512i x_even = _mm512_and_si512(x, lo8), x_odd = _mm512_srli_epi16(x, 8);
    const __m512i w_even = _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8), w_odd = _mm512_srai_epi16(w, 8);
    const __m512i p = _mm512_add_epi32(_mm512_madd_epi16(x_even, w_even), _mm512_madd_epi16(x_odd, w_odd));
    return _mm512_add_epi32(acc, p);
}
#endif

/* Activation row s's quad r (its four u8 inputs 4r .. 4r + 3) in every int32 lane. */
#define W8_BCAST(s) _mm512_set1_epi32(*(const int32_t *)(X + (int64_t)(s) * kp + 4 * r))
/* One activation row s (< mr) of the VNNI loops at quad r: its broadcast quad times the weight quad
 * w, into a[s] (w8_dots_mr, w8_dots_groups_mr; w8_dots2_mr feeds one broadcast to two blocks). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define W8_ROW(s)                                                                                   \
    if ((s) < mr) {                                                                                 \
        const __m512i xb = W8_BCAST(s);                                                             \
        a[s] = W8_DOT(a[s], xb, w);                                                                 \
    }
#if defined(__AVX512VNNI__)
#define W8_DOT(acc, x, w) _mm512_dpbusd_epi32(acc, x, w)
#else
#define W8_DOT(acc, x, w) w8_dot_bw(acc, x, w)
#endif
#endif

/* acc [mr][16] = integer dots of activation rows X (u8, rows kp bytes apart) with the packed
 * block wb, over the klen inputs (a multiple of 64) both start at. */
static inline __attribute__((always_inline)) void w8_dots_mr(const uint8_t *X, const int mr, int64_t kp, int64_t klen,
                                                             const int8_t *wb, int32_t *acc) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512i a[W8_MR];
    for (int s = 0; s < W8_MR; s++) a[s] = _mm512_setzero_si512();
    const int64_t quads = klen / 4;
    if (mr <= 2) {
        /* few rows: 4 chains per row (one per quad mod 4), or vpdpbusd's latency would bound the
         * loop; integer sums do not depend on how they are split */
        __m512i c[8];
        for (int j = 0; j < 8; j++) c[j] = _mm512_setzero_si512();
        for (int64_t r = 0; r < quads; r += 4)
            for (int j = 0; j < 4; j++) {
                const __m512i w = _mm512_loadu_si512((const void *)(wb + (r + j) * 64));
                for (int s = 0; s < mr; s++) {
                    const __m512i xb = _mm512_set1_epi32(*(const int32_t *)(X + (int64_t)s * kp + 4 * (r + j)));
                    c[4 * s + j] = W8_DOT(c[4 * s + j], xb, w);
                }
            }
        for (int s = 0; s < mr; s++)
            a[s] = _mm512_add_epi32(_mm512_add_epi32(c[4 * s], c[4 * s + 1]), _mm512_add_epi32(c[4 * s + 2], c[4 * s + 3]));
    } else {
        for (int64_t r = 0; r < quads; r++) {
            const __m512i w = _mm512_loadu_si512((const void *)(wb + r * 64));
            W8_ROW(0) W8_ROW(1) W8_ROW(2) W8_ROW(3) W8_ROW(4) W8_ROW(5) W8_ROW(6) W8_ROW(7)
        }
    }
    for (int s = 0; s < mr; s++) _mm512_storeu_si512((void *)(acc + 16 * s), a[s]);
#elif defined(DUET_AVX2)
    /* signed activations (w8_signed): AVX2 has no vpdpbusd; vpmaddubsw multiplies unsigned by
     * signed bytes and adds pairs into int16 with saturation, which |x| <= 127 and |w| <= 127 keep
     * clear of (2 * 127 * 127 < 32767): |x| times w with x's sign (vpsignb), the pairs of pairs
     * added by vpmaddwd against ones. Four activation rows at a time against both halves of the
     * block (8 accumulators, the two weight vectors, the broadcast quad, its |x|, a product and
     * the ones). Exact integer sums, so the same values as every other path. */
    const __m256i ones = _mm256_set1_epi16(1);
    for (int s0 = 0; s0 < mr; s0 += 4) {
        __m256i a[4][2];
        for (int s = 0; s < 4; s++) a[s][0] = a[s][1] = _mm256_setzero_si256();
        for (int64_t r = 0; r < klen / 4; r++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + r * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + r * 64 + 32));
            for (int s = 0; s < 4 && s0 + s < mr; s++) {
                const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(X + (int64_t)(s0 + s) * kp + 4 * r));
                const __m256i ax = _mm256_abs_epi8(xb);
                a[s][0] = _mm256_add_epi32(a[s][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb)), ones));
                a[s][1] = _mm256_add_epi32(a[s][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb)), ones));
            }
        }
        for (int s = 0; s < 4 && s0 + s < mr; s++) {
            _mm256_storeu_si256((__m256i *)(acc + 16 * (s0 + s)), a[s][0]);
            _mm256_storeu_si256((__m256i *)(acc + 16 * (s0 + s) + 8), a[s][1]);
        }
    }
#else
    for (int s = 0; s < mr; s++)
        for (int n = 0; n < 16; n++) {
            int32_t sum = 0;
            for (int64_t i = 0; i < klen; i++) sum += (int32_t)X[(int64_t)s * kp + i] * (int32_t)wb[(i >> 2) * 64 + n * 4 + (i & 3)];
            acc[16 * s + n] = sum;
        }
#endif
}

#if defined(__AVX512VNNI__)
/* acc [mr][32] = w8_dots_mr of both blocks of a pair (wb0, wb1) in one pass: one broadcast
 * activation quad feeds two vpdpbusd (2 mr accumulators). Integer sums: the same values. */
static inline __attribute__((always_inline)) void w8_dots2_mr(const uint8_t *X, const int mr, int64_t kp, int64_t klen,
                                                              const int8_t *wb0, const int8_t *wb1, int32_t *acc,
                                                              const int8_t *pf) {
    __m512i a[W8_MR][2];
    for (int s = 0; s < mr; s++) a[s][0] = a[s][1] = _mm512_setzero_si512();
    for (int64_t r = 0; r < klen / 4; r++) {
        if (pf) { /* the next pair's two blocks (W8_PF_ROWS) */
            _mm_prefetch((const char *)(pf + r * 64), _MM_HINT_T1);
            _mm_prefetch((const char *)(pf + (wb1 - wb0) + r * 64), _MM_HINT_T1);
        }
        const __m512i w0 = _mm512_loadu_si512((const void *)(wb0 + r * 64));
        const __m512i w1 = _mm512_loadu_si512((const void *)(wb1 + r * 64));
        for (int s = 0; s < mr; s++) {
            const __m512i xb = W8_BCAST(s);
            a[s][0] = _mm512_dpbusd_epi32(a[s][0], xb, w0);
            a[s][1] = _mm512_dpbusd_epi32(a[s][1], xb, w1);
        }
    }
    for (int s = 0; s < mr; s++) {
        _mm512_storeu_si512((void *)(acc + 32 * s), a[s][0]);
        _mm512_storeu_si512((void *)(acc + 32 * s + 16), a[s][1]);
    }
}
#endif

#if defined(__AVX512VNNI__)
/* w8_dots2_mr of 8 rows fetching the next pair (W8_PF_ROWS), out of line: inlined beside the
 * other copy it made 512-row calls ~5 % slower, prefetching nothing */
static __attribute__((noinline)) void w8_dots2_pf(const uint8_t *X, int64_t kp, const int8_t *wb0, int64_t blk,
                                                  int32_t *acc) {
    w8_dots2_mr(X, W8_MR, kp, kp, wb0, wb0 + blk, acc, wb0 + 2 * blk);
}
#endif

/* w8_dots_mr with the row count a constant per call, so the sums are registers (a runtime row count
 * indexing the array cost the grouped path 13-16 %; see w8_dots_groups). */
static void w8_dots(const uint8_t *X, int mr, int64_t kp, int64_t klen, const int8_t *wb, int32_t *acc) {
#define W8_DOTS_MR(r) w8_dots_mr(X, r, kp, klen, wb, acc)
    CONST_ROWS_SWITCH(mr, W8_MR, W8_DOTS_MR)
#undef W8_DOTS_MR
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* tot [mr][16] (3 <= mr <= W8_MR) = a grouped row's totals for outputs nb .. nb + cnt: w8_dots of
 * each group, then w8_group_add's tot += (float)(sums - 128 wsum_g) * sx_g in group order, with the
 * sums and totals kept in registers between groups (the separate calls stored and reloaded both
 * for every group: ~28 % of the dots' time at groups of 128). The same operations on the same
 * values, so the same bits. */
static inline __attribute__((always_inline)) void w8_dots_groups_mr(const uint8_t *X, const int mr, int64_t kp, int64_t g,
                                                                    int64_t groups, const int8_t *wb, const float *sx,
                                                                    const int32_t *wsum, int64_t n, int64_t nb, int cnt,
                                                                    float *tot) {
    const __mmask16 mk = (__mmask16)(cnt >= 16 ? 0xffff : (1u << cnt) - 1);
    __m512 t[W8_MR];
    for (int s = 0; s < W8_MR; s++) t[s] = _mm512_setzero_ps();
    for (int64_t j = 0; j < groups; j++) {
        const int64_t q0 = j * g / 4, q1 = (j * g + g < kp ? j * g + g : kp) / 4;
        __m512i a[W8_MR];
        for (int s = 0; s < W8_MR; s++) a[s] = _mm512_setzero_si512();
        for (int64_t r = q0; r < q1; r++) {
            const __m512i w = _mm512_loadu_si512((const void *)(wb + r * 64));
            W8_ROW(0) W8_ROW(1) W8_ROW(2) W8_ROW(3) W8_ROW(4) W8_ROW(5) W8_ROW(6) W8_ROW(7)
        }
        const __m512i ws = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mk, wsum + j * n + nb), 7);
        for (int s = 0; s < mr; s++)
            t[s] = _mm512_add_ps(t[s], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[s], ws)),
                                                     _mm512_set1_ps(sx[(int64_t)s * groups + j])));
    }
    for (int s = 0; s < mr; s++) _mm512_storeu_ps(tot + 16 * s, t[s]);
}

/* w8_dots_groups_mr with the row count a constant (8, or the last tile's 3..7), so the sums and
 * totals are registers, not an array indexed at run time. */
static void w8_dots_groups(const uint8_t *X, int mr, int64_t kp, int64_t g, int64_t groups, const int8_t *wb,
                           const float *sx, const int32_t *wsum, int64_t n, int64_t nb, int cnt, float *tot) {
    if (mr < 3) __builtin_unreachable(); /* one or two rows take w8_dots' four-chain path */
#define W8_DOTS_GROUPS_MR(r) w8_dots_groups_mr(X, r, kp, g, groups, wb, sx, wsum, n, nb, cnt, tot)
    CONST_ROWS_SWITCH(mr, W8_MR, W8_DOTS_GROUPS_MR)
#undef W8_DOTS_GROUPS_MR
}
#endif

#if defined(W8_AMX)
/* Tiles 0..3 = the int32 sums of activation rows [0, 16) (and [16, 32) when `two`; signed bytes,
 * rows kp apart) against the weight blocks wb0 and wb1 (16 outputs each) over inputs [c0, c1)
 * (multiples of 64). tdpbssd multiplies signed by signed: no +128 offset, no wsum correction. */
INLINE void w8_amx_block(const uint8_t *X, int64_t kp, int64_t c0, int64_t c1, int two, const int8_t *wb0,
                         const int8_t *wb1) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = c0; c < c1; c += 64) {
        _tile_loadd(6, wb0 + c * 16, 64);
        _tile_loadd(7, wb1 + c * 16, 64);
        _tile_loadd(4, X + c, kp);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        if (two) {
            _tile_loadd(5, X + 16 * kp + c, kp);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
        }
    }
}

/* Tiles 0..3 (w8_amx_block's sums) into buf [32][32] (int32, rows 16..31 only when `two`). */
INLINE void w8_amx_stash(int32_t *buf, int two) {
    _tile_stored(0, buf, 128);
    _tile_stored(1, buf + 16, 128);
    if (two) {
        _tile_stored(2, buf + 16 * 32, 128);
        _tile_stored(3, buf + 16 * 32 + 16, 128);
    }
}

/* The int32 sums of 32 outputs [n0, n0 + 32) for `rows` activation rows (buf [rows][32], tile-
 * stored) out as ((float)acc * sx[row]) * sw (+ bias): w8_epilogue's arithmetic, with the pair's
 * scales and bias loaded once and a whole pair's 32 bf16 outputs written as one 64-byte store,
 * non-temporal with `nt` (common.h: NT_OUTPUT_BYTES). */
static void w8_amx_store_rows(const int32_t *buf, int rows, const float *sx, int64_t n0, int64_t n, const float *scale,
                              const void *bias, char *out, int64_t orow, int obf16, int nt) {
#if defined(__AVX512F__)
    if (n0 + 32 <= n) {
        const __m512 sw0 = _mm512_loadu_ps(scale + n0), sw1 = _mm512_loadu_ps(scale + n0 + 16);
        __m512 b0 = _mm512_setzero_ps(), b1 = b0;
        if (bias) b0 = load16(bias, n0, obf16), b1 = load16(bias, n0 + 16, obf16);
        for (int s = 0; s < rows; s++) {
            const __m512 vs = _mm512_set1_ps(sx[s]);
            __m512 v0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(buf + 32 * s))), vs), sw0);
            __m512 v1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(buf + 32 * s + 16))), vs), sw1);
            if (bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
            char *row = out + (int64_t)s * orow;
            if (obf16) {
                store64((uint16_t *)row + n0, _mm512_inserti64x4(_mm512_castsi256_si512(cvt16_bf16(v0)), cvt16_bf16(v1), 1), nt);
            } else {
                store16(row, n0, v0, 0);
                store16(row, n0 + 16, v1, 0);
            }
        }
        return;
    }
#endif
    for (int s = 0; s < rows; s++)
        for (int h = 0; h < 2 && n0 + 16 * h < n; h++) {
            const int cnt = (int)(n - n0 - 16 * h < 16 ? n - n0 - 16 * h : 16);
            w8_epilogue(buf + 32 * s + 16 * h, cnt, sx[s], scale, NULL, bias, n0 + 16 * h, out + (int64_t)s * orow, obf16);
        }
}

/* Activation rows [0, m16) (a multiple of 16, signed bytes; `rows` of them real) against the
 * pair of blocks wb0, wb0 + kp*16 (outputs [n0, n0 + 32)), per token scales sx, into out.
 * tdpbssd multiplies signed by signed, so the AMX path needs no +128 offset and no wsum
 * correction. 32 rows at a time; each 32x32 block's tiles go through an L1 buffer (buf: two
 * [32][32] halves), and block i-1's epilogue (AVX-512) is issued after block i's tdpbssd, so the
 * two run side by side: with K = 576 the epilogue alone took ~60 % of the time when it ran after
 * all the pair's rows (measured, 512 x 3072 x 576, one thread). */
static void w8_amx_rows(const uint8_t *X, int m16, int rows, int64_t kp, const int8_t *wb0, const float *sx,
                        int32_t *buf, int64_t n0, int64_t n, const float *scale, const void *bias, char *out,
                        int64_t orow, int obf16, int nt) {
    const int8_t *wb1 = wb0 + kp * 16;
    const int blocks = (m16 + 31) / 32;
    for (int i = 0; i <= blocks; i++) {
        const int mi = 32 * i, two = mi + 16 < m16;
        if (i < blocks) w8_amx_block(X + (int64_t)mi * kp, kp, 0, kp, two, wb0, wb1);
        if (i > 0) {
            const int pm = mi - 32, real = rows - pm < 32 ? rows - pm : 32;
            if (real > 0)
                w8_amx_store_rows(buf + ((i - 1) & 1) * 1024, real, sx + pm, n0, n, scale, bias, out + (int64_t)pm * orow,
                                  orow, obf16, nt);
        }
        if (i < blocks) w8_amx_stash(buf + (i & 1) * 1024, two);
    }
}

/* One group's int32 sums of a chunk (buf [rows][32], tile-stored) into its fp32 totals tot
 * [rows][32]: tot += (float)acc * sx[row, j], in group order (j = 0 starts from 0.f, so 0 + a is
 * rounded as the reference rounds it). The last group's totals go straight out: tot * sw (+ bias),
 * one rounding at the store. rows: the chunk's real rows (padding rows are never stored). */
static void w8_amx_dequant(const int32_t *buf, int rows, const float *sx, int64_t groups, int64_t j, float *tot,
                           int64_t n0, int64_t n, const float *scale, const void *bias, char *out, int64_t orow,
                           int obf16) {
    const int first = j == 0, last = j == groups - 1;
#if defined(__AVX512F__)
    if (n0 + 32 <= n) {
        /* whole pair: two vectors per row, the row's group scale broadcast once */
        const __m512 sw0 = _mm512_loadu_ps(scale + n0), sw1 = _mm512_loadu_ps(scale + n0 + 16);
        __m512 b0 = _mm512_setzero_ps(), b1 = b0;
        if (last && bias) b0 = load16(bias, n0, obf16), b1 = load16(bias, n0 + 16, obf16);
        for (int s = 0; s < rows; s++) {
            const __m512 vs = _mm512_set1_ps(sx[(int64_t)s * groups + j]);
            const __m512 a0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(buf + 32 * s))), vs);
            const __m512 a1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(buf + 32 * s + 16))), vs);
            const __m512 t0 = _mm512_add_ps(first ? _mm512_setzero_ps() : _mm512_load_ps(tot + 32 * s), a0);
            const __m512 t1 = _mm512_add_ps(first ? _mm512_setzero_ps() : _mm512_load_ps(tot + 32 * s + 16), a1);
            if (!last) {
                _mm512_store_ps(tot + 32 * s, t0);
                _mm512_store_ps(tot + 32 * s + 16, t1);
                continue;
            }
            __m512 v0 = _mm512_mul_ps(t0, sw0), v1 = _mm512_mul_ps(t1, sw1);
            if (bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
            char *row = out + (int64_t)s * orow;
            store16(row, n0, v0, obf16);
            store16(row, n0 + 16, v1, obf16);
        }
        return;
    }
#endif
    /* a pair past n's end: the generic per-16 steps */
    for (int s = 0; s < rows; s++)
        for (int h = 0; h < 2 && n0 + 16 * h < n; h++) {
            const int cnt = (int)(n - n0 - 16 * h < 16 ? n - n0 - 16 * h : 16);
            float *t = tot + 32 * s + 16 * h;
            if (first) memset(t, 0, sizeof(float) * 16);
            w8_group_add(buf + 32 * s + 16 * h, cnt, sx[(int64_t)s * groups + j], NULL, n0 + 16 * h, t);
            if (last) w8_group_store(t, cnt, scale, bias, n0 + 16 * h, out + (int64_t)s * orow, obf16);
        }
}

/* Grouped AMX: activation rows [0, rows16) (16 or 32, signed bytes; `rows` of them real) against
 * the pair of blocks wb0, wb0 + kp*16, one activation scale per g inputs (sx: [rows][groups]),
 * into out. The group loop is innermost, so each group's 32x32 int32 block goes through L1 only
 * (buf: two [32][32] halves, tot: [32][32] fp32), and group j's dequantization (AVX-512) is
 * issued after group j+1's tdpbssd, so the two run side by side instead of one after the other
 * (the sums and their fp32 order are the same as group by group). */
static void w8_amx_grouped(const uint8_t *X, int rows16, int rows, int64_t kp, int64_t g, int64_t groups,
                           const int8_t *wb0, const float *sx, int32_t *buf, float *tot, int64_t n0, int64_t n,
                           const float *scale, const void *bias, char *out, int64_t orow, int obf16) {
    const int8_t *wb1 = wb0 + kp * 16;
    const int two = rows16 > 16;
    for (int64_t j = 0; j <= groups; j++) {
        if (j < groups) w8_amx_block(X, kp, j * g, (j + 1) * g < kp ? (j + 1) * g : kp, two, wb0, wb1);
        if (j > 0)
            w8_amx_dequant(buf + ((j - 1) & 1) * 1024, rows, sx, groups, j - 1, tot, n0, n, scale, bias, out, orow,
                           obf16);
        if (j < groups) w8_amx_stash(buf + (j & 1) * 1024, two);
    }
}
#endif

/* out [m][os] = W8A8(x [m][xs], packed weights wp, scale [n]) + bias; x bf16 (bf16 != 0) or fp32;
 * out and bias in x's dtype, or out fp32 with out_f32. wp: see the file comment (n padded to 32,
 * k to 64); wsum[g][n] = sum over group g's inputs of q[n, k]. group: inputs per activation scale
 * (0: one scale per row; else a multiple of 64). Returns 0, -1 when out of memory, -2 for a group
 * that is not a multiple of 64. */
int32_t qlinear_w8a8(const void *x, int64_t xs, int32_t m, int32_t k, const int8_t *wp, const float *scale,
                     const int32_t *wsum, int64_t n, const void *bias, void *out, int64_t os, int32_t bf16,
                     int32_t out_f32, int32_t group) {
    const int64_t kp = w8_pad64(k), pairs = (n + 31) / 32, blk = kp * 16;
    if (group < 0 || group % 64) return -2;
    const int64_t g = group == 0 || group >= kp ? kp : group, groups = (k + g - 1) / g;
    const int mpad = (m + 15) & ~15;
    uint8_t *X = (uint8_t *)aligned_alloc(64, (size_t)(mpad * kp + 64));
    float *sx = (float *)malloc(sizeof(float) * (size_t)m * (size_t)groups);
    if (!X || !sx) {
        free(X);
        free(sx);
        return -1;
    }
    const int obf16 = bf16 && !out_f32, esz = obf16 ? 2 : 4;
    const int64_t xsz = bf16 ? 2 : 4;
    int amx = 0;
#if defined(W8_AMX)
    amx = m >= 16 && amx_permitted();
#endif
    /* AMX: signed activations (tdpbssd); AVX2 too (w8_dots_mr's vpmaddubsw on |x| and w's sign
     * flipped by x's); VNNI and portable: unsigned (vpdpbusd), 128 wsum taken back after */
    const int off = amx || W8_SIGNED ? 0 : 128;
    const int32_t *ws = off ? wsum : NULL; /* signed sums: nothing to take back */
    const int nt = (int64_t)m * n * esz > NT_OUTPUT_BYTES; /* w8_amx_store_rows */
    (void)nt; /* used by the AMX path only */
#pragma omp parallel for schedule(static) if ((int64_t)m * k >= (1 << 16))
    for (int r = 0; r < m; r++)
        w8_quant_row((const char *)x + r * xs * xsz, k, kp, g, bf16, off, X + (int64_t)r * kp, sx + r * groups);
    memset(X + (int64_t)m * kp, off, (size_t)((mpad - m) * kp));
    int fail = 0;
#pragma omp parallel if ((int64_t)m * n * k >= (1 << 15))
    {
        /* AMX: [mpad][32] per pair of blocks; VNNI: [W8_MR][32] (a pair's two blocks, w8_dots2_mr) or
         * [W8_MR][16]; grouped: fp32 totals of the same shape */
        const size_t tile = (size_t)(amx ? W8_AMX_MB * 32 : W8_MR * 32);
        int32_t *acc = (int32_t *)aligned_alloc(64, sizeof(int32_t) * tile);
        float *tot = groups > 1 ? (float *)aligned_alloc(64, sizeof(float) * tile) : NULL;
        if (!acc || (groups > 1 && !tot)) {
#pragma omp atomic write
            fail = 1;
        }
#if defined(W8_AMX)
        if (amx && acc) amx_configure_16x64();
#endif
        /* AMX: W8_AMX_MB activation rows per pass over the weights, so the pass's outputs stay in
         * L2 while they are written (a whole prefill's outputs of a wide layer would not) */
        const int pass = amx ? W8_AMX_MB : mpad;
        for (int m0 = 0; m0 < mpad; m0 += pass) {
            const int mb = mpad - m0 < pass ? mpad - m0 : pass;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++) {
                if (!acc || (groups > 1 && !tot)) continue;
                const int64_t n0 = 32 * p;
#if defined(W8_AMX)
                if (amx) {
                    if (groups > 1) {
                        for (int mi = 0; mi < mb && m0 + mi < m; mi += 32) {
                            const int r16 = mb - mi < 32 ? mb - mi : 32, real = m - m0 - mi < r16 ? m - m0 - mi : r16;
                            w8_amx_grouped(X + (int64_t)(m0 + mi) * kp, r16, real, kp, g, groups, wp + 2 * p * blk,
                                           sx + (int64_t)(m0 + mi) * groups, acc, tot, n0, n, scale, bias,
                                           (char *)out + (int64_t)(m0 + mi) * os * esz, os * esz, obf16);
                        }
                        continue;
                    }
                    w8_amx_rows(X + (int64_t)m0 * kp, mb, m - m0, kp, wp + 2 * p * blk, sx + m0, acc, n0, n, scale, bias,
                                (char *)out + (int64_t)m0 * os * esz, os * esz, obf16, nt);
                    continue;
                }
#endif
#if defined(__AVX512VNNI__)
                if (groups == 1 && n0 + 16 < n) { /* both blocks of the pair, full tiles in one pass */
                    const int cnt1 = (int)(n - n0 - 16 < 16 ? n - n0 - 16 : 16);
                    const int8_t *wb0 = wp + 2 * p * blk;
                    for (int mi = 0; mi < m; mi += W8_MR) {
                        const int mr = m - mi < W8_MR ? m - mi : W8_MR;
                        if (mr == W8_MR) {
                            if (mi == 0 && m < W8_PF_ROWS && p + 1 < pairs)
                                w8_dots2_pf(X, kp, wb0, blk, acc);
                            else
                                w8_dots2_mr(X + (int64_t)mi * kp, W8_MR, kp, kp, wb0, wb0 + blk, acc, NULL);
                            for (int s = 0; s < mr; s++) {
                                char *row = (char *)out + (int64_t)(mi + s) * os * esz;
                                w8_epilogue(acc + 32 * s, 16, sx[mi + s], scale, wsum, bias, n0, row, obf16);
                                w8_epilogue(acc + 32 * s + 16, cnt1, sx[mi + s], scale, wsum, bias, n0 + 16, row, obf16);
                            }
                            continue;
                        }
                        for (int h = 0; h < 2; h++) {
                            w8_dots(X + (int64_t)mi * kp, mr, kp, kp, wb0 + h * blk, acc);
                            for (int s = 0; s < mr; s++)
                                w8_epilogue(acc + 16 * s, h ? cnt1 : 16, sx[mi + s], scale, wsum, bias, n0 + 16 * h,
                                            (char *)out + (int64_t)(mi + s) * os * esz, obf16);
                        }
                    }
                    continue;
                }
#endif
                for (int h = 0; h < 2 && n0 + 16 * h < n; h++) {
                    const int64_t nb = n0 + 16 * h;
                    const int cnt = (int)(n - nb < 16 ? n - nb : 16);
                    const int8_t *wb = wp + (2 * p + h) * blk;
                    for (int mi = 0; mi < m; mi += W8_MR) {
                        const int mr = m - mi < W8_MR ? m - mi : W8_MR;
                        if (groups == 1) {
                            w8_dots(X + (int64_t)mi * kp, mr, kp, kp, wb, acc);
                            for (int s = 0; s < mr; s++)
                                w8_epilogue(acc + 16 * s, cnt, sx[mi + s], scale, ws, bias, nb,
                                            (char *)out + (int64_t)(mi + s) * os * esz, obf16);
                            continue;
                        }
                        int fused = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
                        if (mr > 2) {
                            w8_dots_groups(X + (int64_t)mi * kp, mr, kp, g, groups, wb, sx + (int64_t)mi * groups, wsum, n,
                                           nb, cnt, tot);
                            fused = 1;
                        }
#endif
                        if (!fused) {
                            memset(tot, 0, sizeof(float) * (size_t)mr * 16);
                            for (int64_t j = 0; j < groups; j++) {
                                const int64_t c0 = j * g, len = (c0 + g < kp ? g : kp - c0);
                                w8_dots(X + (int64_t)mi * kp + c0, mr, kp, len, wb + c0 * 16, acc);
                                for (int s = 0; s < mr; s++)
                                    w8_group_add(acc + 16 * s, cnt, sx[(int64_t)(mi + s) * groups + j], ws ? ws + j * n : NULL, nb,
                                                 tot + 16 * s);
                            }
                        }
                        for (int s = 0; s < mr; s++)
                            w8_group_store(tot + 16 * s, cnt, scale, bias, nb, (char *)out + (int64_t)(mi + s) * os * esz, obf16);
                    }
                }
            }
        }
#if defined(W8_AMX)
        if (amx && acc) _tile_release();
#endif
#if defined(__AVX512F__)
        if (nt) _mm_sfence(); /* non-temporal stores are weakly ordered: visible before the caller reads */
#endif
        free(acc);
        free(tot);
    }
    free(X);
    free(sx);
    return fail ? -1 : 0;
}
