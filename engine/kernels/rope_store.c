/*
 * Rotary embedding of q and k in place in the fused qkv activations, and the write of the
 * step's K/V into their pool slots: one pass instead of ~10 torch ops and an index_put.
 *
 * Bit-exact with the torch path (engine/rope.py: x * cos + rotate_half(x) * sin in the model
 * dtype): each product and the sum are rounded to the model dtype as torch does, and this file
 * is compiled with -ffp-contract=off so no FMA merges them. That keeps fp32 greedy output
 * token-identical to transformers. Into an int8 pool (Step.kv_int8) each kv head's K and V row is
 * quantized as engine/kv_quant.py quantizes it, byte for byte.
 */
#include "common.h"
#include "step.h"
#include "vec8.h"

#if defined(DUET_VEC8)
/* rotate_head's arithmetic 8 pairs at a time (half % 8 == 0): the same products, roundings and
 * sums lane for lane, so bitwise the scalar loop's result. */
INLINE void rotate_head8(void *x, int64_t o, const void *cs, const void *sn, int64_t to, int half, int bf16) {
    const int64_t esz = bf16 ? 2 : 4;
    char *h = (char *)x + esz * o;
    const char *c = (const char *)cs + esz * to, *sv = (const char *)sn + esz * to;
    for (int j = 0; j < half; j += 8) {
        const __m256 x1 = load8(h, j, bf16), x2 = load8(h, j + half, bf16);
        __m256 a1 = _mm256_mul_ps(x1, load8(c, j, bf16)), b1 = _mm256_mul_ps(x2, load8(sv, j, bf16));
        __m256 a2 = _mm256_mul_ps(x2, load8(c, j + half, bf16)), b2 = _mm256_mul_ps(x1, load8(sv, j + half, bf16));
        if (bf16) a1 = vec8_round_bf16(a1), b1 = vec8_round_bf16(b1), a2 = vec8_round_bf16(a2), b2 = vec8_round_bf16(b2);
        store8(h, j, _mm256_sub_ps(a1, b1), bf16);
        store8(h, j + half, _mm256_add_ps(a2, b2), bf16);
    }
}
#endif

INLINE void rotate_head(void *x, int64_t o, const void *cs, const void *sn, int64_t to, int half, int bf16) {
    if (bf16) {
        uint16_t *h = (uint16_t *)x + o;
        const uint16_t *c = (const uint16_t *)cs + to, *sv = (const uint16_t *)sn + to;
        for (int j = 0; j < half; j++) {
            const float x1 = bf16_to_f32(h[j]), x2 = bf16_to_f32(h[j + half]);
            const float a1 = bf16_to_f32(f32_to_bf16(x1 * bf16_to_f32(c[j])));
            const float b1 = bf16_to_f32(f32_to_bf16(x2 * bf16_to_f32(sv[j])));
            const float a2 = bf16_to_f32(f32_to_bf16(x2 * bf16_to_f32(c[j + half])));
            const float b2 = bf16_to_f32(f32_to_bf16(x1 * bf16_to_f32(sv[j + half])));
            h[j] = f32_to_bf16(a1 - b1);
            h[j + half] = f32_to_bf16(a2 + b2);
        }
    } else {
        float *h = (float *)x + o;
        const float *c = (const float *)cs + to, *sv = (const float *)sn + to;
        for (int j = 0; j < half; j++) {
            const float x1 = h[j], x2 = h[j + half];
            const float a1 = x1 * c[j], b1 = x2 * sv[j];
            const float a2 = x2 * c[j + half], b2 = x1 * sv[j + half];
            h[j] = a1 - b1;
            h[j + half] = a2 + b2;
        }
    }
}

/* dst[0..D) = x / scale rounded half to even and clamped to [-127, 127], dst[D..D+4) = scale's bytes,
 * scale = max|x| / 127 (0 for an all-zero row, read back as zeros): the torch quantizer's
 * (engine/kv_quant.py) operations in its order and fp32 roundings, so the bytes are its bytes. */
INLINE void quantize_row(const void *x, int64_t o, int D, int bf16, int8_t *dst) {
    float m = 0.f;
    for (int e = 0; e < D; e++) m = fmaxf(m, fabsf(load_elem(x, o + e, bf16)));
    const float scale = m / 127.0f, inv = scale > 0.f ? 1.0f / scale : 0.f;
    for (int e = 0; e < D; e++) {
        const float v = nearbyintf(load_elem(x, o + e, bf16) * inv);
        dst[e] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
    }
    __builtin_memcpy(dst + D, &scale, sizeof scale);
}

static void run(const Step *s, int layer, void *qkv, int64_t qkv_stride, int bf16) {
    const int H = s->num_heads, KVH = s->num_kv_heads, D = s->head_dim, T = s->num_tokens;
    const int64_t esz = bf16 ? 2 : 4, tok = (int64_t)KVH * D;
#pragma omp parallel for schedule(static) if (T >= 64)
    for (int t = 0; t < T; t++) {
        const int64_t row = (int64_t)t * qkv_stride, to = s->positions[t] * D;
        for (int h = 0; h < H + KVH; h++) {
#if defined(DUET_VEC8)
            if ((D & 15) == 0) {
                rotate_head8(qkv, row + (int64_t)h * D, s->cos, s->sin, to, D / 2, bf16);
                continue;
            }
#endif
            rotate_head(qkv, row + (int64_t)h * D, s->cos, s->sin, to, D / 2, bf16);
        }
        const int64_t kv = row + (int64_t)H * D;
        if (s->kv_int8) {
            const int64_t rtok = (int64_t)KVH * (D + 4);
            int8_t *dst = (int8_t *)s->cache + s->slot_block[t] * s->block_stride + layer * s->layer_stride
                + s->slot_offset[t] * rtok;
            for (int h = 0; h < KVH; h++) {
                quantize_row(qkv, kv + (int64_t)h * D, D, bf16, dst + h * (D + 4));                      /* K */
                quantize_row(qkv, kv + tok + (int64_t)h * D, D, bf16, dst + s->block_size * rtok + h * (D + 4)); /* V */
            }
            continue;
        }
        char *dst = (char *)s->cache
            + esz * (s->slot_block[t] * s->block_stride + layer * s->layer_stride + s->slot_offset[t] * tok);
        const char *src = (const char *)qkv + esz * kv;
        __builtin_memcpy(dst, src, esz * tok);                                 /* K */
        __builtin_memcpy(dst + esz * s->block_size * tok, src + esz * tok, esz * tok); /* V */
    }
}

/* Rotate q and k of the step's tokens in place and store k, v in the pool. */
void rope_store(const Step *s, int32_t layer, void *qkv, int64_t qkv_stride) {
    if (s->bf16) run(s, layer, qkv, qkv_stride, 1);
    else run(s, layer, qkv, qkv_stride, 0);
}
