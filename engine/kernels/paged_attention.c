/*
 * Paged decode attention on the CPU, reading K/V in place from the block-major pool.
 *
 * One query token per sequence (decode). For each (sequence, kv head) the G = H / KVH query
 * heads that share the kv head are processed together: scores over the sequence's context
 * (blocks looked up in its block table), a softmax in fp32, then the V-weighted sum. Nothing
 * is gathered or copied, so a step reads each sequence's KV exactly once; torch's gather +
 * SDPA path copies it first and is dominated by batched tiny matmuls.
 *
 * Pool layout (elements): [num_blocks][layers][2][block_size][kv_heads][head_dim]; the
 * caller passes the element offset of the layer and the block stride.
 * Threads: OpenMP, resolved against the libgomp torch already loaded (one thread pool).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_GROUP_DIM 16384 /* num_heads * head_dim handled with stack buffers */

#if defined(__AVX512F__)
/* 16 consecutive elements of the pool as fp32. */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, int bf16) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}
#endif

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } v = { .u = ((uint32_t)((const uint16_t *)p)[i]) << 16 };
        return v.f;
    }
    return ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void store(void *p, int64_t i, float f, int bf16) {
    if (bf16) {
        union { float f; uint32_t u; } v = { .f = f };
        uint32_t u = v.u;
        if ((u & 0x7fffffffu) > 0x7f800000u) { ((uint16_t *)p)[i] = (uint16_t)((u >> 16) | 0x40); return; }
        u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)p)[i] = f;
    }
}

static inline __attribute__((always_inline)) void decode_attention(
    const void *q, int64_t q_token_stride, const void *cache, int64_t layer_offset,
    int64_t block_stride, const int64_t *block_table, int64_t table_width, const int32_t *ctx_lens,
    int32_t window, void *out, int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads,
    int32_t head_dim, int32_t block_size, float scale, int bf16) {
    const int G = num_heads / num_kv_heads;
    const int D = head_dim;
    const int H = num_heads;
    const int64_t tok_stride = (int64_t)num_kv_heads * D;
    const int64_t v_offset = (int64_t)block_size * tok_stride;
#if defined(__AVX512F__)
    const int vec = (D & 15) == 0;
#endif
    /* One task per sequence: its K (then V) rows are read in pool order, all kv heads of a
     * token together, which keeps the hardware prefetcher on contiguous runs. */
#pragma omp parallel for schedule(dynamic, 1)
    for (int b = 0; b < num_seqs; b++) {
        const int ctx = ctx_lens[b];
        const int start = (window > 0 && ctx > window) ? ctx - window : 0;
        const int n = ctx - start;
        float qf[MAX_GROUP_DIM], acc[MAX_GROUP_DIM];
        float *sc = (float *)malloc(sizeof(float) * (size_t)H * (size_t)(n > 0 ? n : 1));
        for (int h = 0; h < H; h++)
            for (int d = 0; d < D; d++)
                qf[h * D + d] = load(q, (int64_t)b * q_token_stride + (int64_t)h * D + d, bf16) * scale;
        const int64_t *table = block_table + (int64_t)b * table_width;
        /* scores[h][t] */
        for (int t = 0; t < n; t++) {
            const int pos = start + t;
            const int64_t base = table[pos / block_size] * block_stride + layer_offset + (int64_t)(pos % block_size) * tok_stride;
            for (int h = 0; h < H; h++) {
                const int64_t kb = base + (int64_t)(h / G) * D;
#if defined(__AVX512F__)
                if (vec) {
                    __m512 a = _mm512_setzero_ps();
                    for (int d = 0; d < D; d += 16)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + h * D + d), load16(cache, kb + d, bf16), a);
                    sc[(int64_t)h * n + t] = _mm512_reduce_add_ps(a);
                    continue;
                }
#endif
                float s = 0.f;
                for (int d = 0; d < D; d++) s += qf[h * D + d] * load(cache, kb + d, bf16);
                sc[(int64_t)h * n + t] = s;
            }
        }
        /* softmax per query head */
        for (int h = 0; h < H; h++) {
            float *s = sc + (int64_t)h * n;
            float m = -INFINITY;
#pragma omp simd reduction(max : m)
            for (int t = 0; t < n; t++) m = fmaxf(m, s[t]);
            float sum = 0.f;
            for (int t = 0; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
            const float inv = 1.f / sum;
            for (int t = 0; t < n; t++) s[t] *= inv;
        }
        /* weighted sum of V */
        for (int i = 0; i < H * D; i++) acc[i] = 0.f;
        for (int t = 0; t < n; t++) {
            const int pos = start + t;
            const int64_t base = table[pos / block_size] * block_stride + layer_offset + v_offset + (int64_t)(pos % block_size) * tok_stride;
            for (int kh = 0; kh < num_kv_heads; kh++) {
                const int64_t vb = base + (int64_t)kh * D;
#if defined(__AVX512F__)
                if (vec) {
                    for (int d = 0; d < D; d += 16) {
                        const __m512 v = load16(cache, vb + d, bf16);
                        for (int g = 0; g < G; g++) {
                            const int h = kh * G + g;
                            float *a = acc + h * D + d;
                            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(sc[(int64_t)h * n + t]), v, _mm512_loadu_ps(a)));
                        }
                    }
                    continue;
                }
#endif
                for (int g = 0; g < G; g++) {
                    const int h = kh * G + g;
                    const float w = sc[(int64_t)h * n + t];
                    for (int d = 0; d < D; d++) acc[h * D + d] += w * load(cache, vb + d, bf16);
                }
            }
        }
        for (int i = 0; i < H * D; i++) store(out, (int64_t)b * H * D + i, acc[i], bf16);
        free(sc);
    }
}

#define ARGS const void *q, int64_t q_token_stride, const void *cache, int64_t layer_offset, \
    int64_t block_stride, const int64_t *block_table, int64_t table_width, const int32_t *ctx_lens, \
    int32_t window, void *out, int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, \
    int32_t head_dim, int32_t block_size, float scale
#define PASS q, q_token_stride, cache, layer_offset, block_stride, block_table, table_width, \
    ctx_lens, window, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale

int paged_decode_max_group_dim(void) { return MAX_GROUP_DIM; }
void paged_decode_attention_f32(ARGS) { decode_attention(PASS, 0); }
void paged_decode_attention_bf16(ARGS) { decode_attention(PASS, 1); }
