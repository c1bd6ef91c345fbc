/*
 * The layers of a decode step in one call: a bf16 engine (bf16 activations and KV, the fp32
 * residual stream) or an fp32 one, over quantized weights, bf16 weights on linear_bf16.c, or fp32
 * weights on the fp32 linear kernel.
 *
 * engine/model.py runs each layer as ~9 Python calls (qkv, rope_store, paged_attention, o, the
 * residual norm, gate_up, SiLU·up, down, the next residual norm), each converting its arguments
 * and allocating its output tensor. A single-stream decode step of a small model is bound by
 * memory bandwidth, so those microseconds are a fixed cost per layer that the GEMVs do not hide
 * (SmolLM2-135M int8, 30 layers: about a fifth of the step at one thread). This file runs the same
 * kernels, in the same order, on the same buffers' values, from C: the step's result is bitwise
 * the one of the Python loop (tests/engine/test_decode_layers.py), only without the round trips.
 *
 * Scope (the caller, LlamaModel.hidden_states, checks it): steps in which each linear takes the same
 * kernel the Python Linear / QLinear would (below BF16_GEMM_MIN_ROWS tokens where bf16 batches
 * switch to the bf16 GEMM path) — decode tokens, and prefill tokens too where the model runs
 * prefill attention on the kernels (a speculative verification's k + 1 tokens, a draft's catch-up
 * feed, a short prompt's chunk); every linear quantized (int8/int4 weight-only or W8A8), a bf16
 * weight in linear_bf16.c's panels, or an fp32 weight on the fp32 kernel; no q/k norms.
 *
 * In (Step.bf16 says which engine): h, the fp32 residual stream [m][hidden] (updated in place); x,
 * [m][hidden] in the activation dtype, the first layer's normed input (scratch afterwards). Out: h
 * after the last layer (its down projection added, not normed). The norms are the Python loop's:
 * bf16 res_norm_f32 (bf16 weights) and silu_mul_bf16; fp32 add_rms_norm_f32 and silu_mul_f32.
 * Returns 0, -1 when out of memory, or a linear kernel's error code.
 */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "step.h"

enum { DEC_INT8 = 1, DEC_INT4 = 2, DEC_W8A8 = 3, DEC_W4A8 = 4, DEC_BF16 = 5, DEC_F32 = 6 };

/* One linear as QLinear (or, DEC_BF16 / DEC_F32, engine/linear.py's Linear) calls it
 * (engine/decode_plan.py builds these). DEC_W4A8 is int4-w4a8: the int4 weight-only GEMV for one
 * row (it reads half the bytes), W8A8 for more. DEC_BF16: a bf16 weight in linear_bf16.c's panels
 * (q). DEC_F32: an fp32 weight [n][k] (q). The bias is in the activation dtype. */
typedef struct {
    int32_t kind;
    int32_t k;
    int64_t n;
    const void *q;      /* weight-only: int8 [n][k] or packed int4; bf16: the panels */
    const void *scales; /* int8: fp32 [n]; int4: fp16 d [n][k / group] */
    const void *mins;   /* int4: fp16 [n][k / group] */
    int32_t group;      /* int4: weights per scale */
    int32_t act_group;  /* W8A8: inputs per activation scale (0: one per row) */
    const void *wp;     /* W8A8: the blocked int8 packing, its fp32 scales and per-group row sums */
    const void *wscale;
    const void *wsum;
    const void *bias; /* [n] in the activation dtype, or NULL */
} DecLinear;

typedef struct {
    const void *input_norm; /* activation dtype */
    const void *post_norm;
    DecLinear qkv, o, gate_up, down;
} DecLayer;

int32_t qlinear_int8(const void *x, int64_t xs, int32_t m, int32_t k, const int8_t *q, const float *scale,
                     int64_t n, const void *bias, void *out, int64_t os, int32_t bf16, int32_t out_f32);
int32_t qlinear_int4(const void *x, int64_t xs, int32_t m, int32_t k, const uint8_t *q, const uint16_t *d,
                     const uint16_t *mins, int32_t group, int64_t n, const void *bias, void *out, int64_t os,
                     int32_t bf16, int32_t out_f32);
int32_t qlinear_w8a8(const void *x, int64_t xs, int32_t m, int32_t k, const int8_t *wp, const float *scale,
                     const int32_t *wsum, int64_t n, const void *bias, void *out, int64_t os, int32_t bf16,
                     int32_t out_f32, int32_t group);
int32_t linear_bf16(const uint16_t *x, int64_t xs, int32_t m, int32_t k, const uint32_t *panels, int64_t n,
                    const uint16_t *bias, void *out, int64_t os, int32_t out_f32, int32_t isa);
void rope_store(const Step *s, int32_t layer, void *qkv, int64_t qkv_stride);
void paged_attention(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q, int64_t q_stride,
                     void *out, int64_t out_stride);
void prefill_attention(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q, int64_t q_stride,
                       void *out, int64_t out_stride);
void res_norm_f32(float *h, const uint16_t *delta, const uint16_t *w, void *out, int32_t rows, int32_t n, float eps,
                  int32_t out_f32);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int32_t rows, int32_t n);
void add_rms_norm_f32(float *h, const float *delta, const float *w, float *out, int32_t rows, int32_t n, float eps);
void silu_mul_f32(const float *gate_up, float *out, int32_t rows, int32_t n);
int32_t linear_f32(const float *x, int64_t xs, int32_t m, int32_t k, const float *w, int64_t n, const float *bias,
                   float *out, int64_t os);

/* out [m][L->n] (activation dtype, rows contiguous) = x [m][L->k] @ W^T + bias, as QLinear._kernel
 * (or Linear) picks. */
static int32_t linear(const DecLinear *L, const void *x, int32_t m, void *out, int bf16) {
    const int kind = L->kind == DEC_W4A8 ? (m == 1 ? DEC_INT4 : DEC_W8A8) : L->kind;
    switch (kind) {
    case DEC_INT8:
        return qlinear_int8(x, L->k, m, L->k, L->q, L->scales, L->n, L->bias, out, L->n, bf16, 0);
    case DEC_INT4:
        return qlinear_int4(x, L->k, m, L->k, L->q, L->scales, L->mins, L->group, L->n, L->bias, out, L->n, bf16, 0);
    case DEC_W8A8:
        return qlinear_w8a8(x, L->k, m, L->k, L->wp, L->wscale, L->wsum, L->n, L->bias, out, L->n, bf16, 0,
                            L->act_group);
    case DEC_BF16:
        return bf16 ? linear_bf16(x, L->k, m, L->k, L->q, L->n, L->bias, out, L->n, 0, 0) : -3;
    case DEC_F32:
        return bf16 ? -3 : linear_f32(x, L->k, m, L->k, L->q, L->n, L->bias, out, L->n);
    default:
        return -3;
    }
}

/* h += delta; x = RMSNorm(h) * w in the activation dtype (the Python loop's _add_norm). */
static void add_norm(float *h, const void *delta, const void *w, void *x, int32_t m, int32_t hidden, float eps,
                     int bf16) {
    if (bf16) res_norm_f32(h, delta, w, x, m, hidden, eps, 0);
    else add_rms_norm_f32(h, delta, w, x, m, hidden, eps);
}

int32_t decode_layers(const Step *s, const DecLayer *layers, int32_t num_layers, float *h, void *x, int32_t m,
                      int32_t num_decode, int32_t hidden, int32_t inter, float eps) {
    const int bf16 = s->bf16;
    const int64_t esz = bf16 ? 2 : 4, qkv_n = layers[0].qkv.n, attn_n = (int64_t)s->num_heads * s->head_dim;
    /* one allocation for the layer's intermediates (activation dtype), reused by every layer */
    char *qkv = (char *)malloc((size_t)(esz * m * (qkv_n + attn_n + hidden + 2 * (int64_t)inter + inter + hidden)));
    if (!qkv) return -1;
    char *attn = qkv + esz * m * qkv_n, *o = attn + esz * m * attn_n, *gu = o + esz * m * hidden;
    char *act = gu + esz * m * 2 * inter, *down = act + esz * m * inter;
    int32_t rc = 0;
    for (int i = 0; i < num_layers && rc == 0; i++) {
        const DecLayer *L = layers + i;
        if ((rc = linear(&L->qkv, x, m, qkv, bf16))) break;
        rope_store(s, i, qkv, qkv_n);
        /* as engine/attention.py's paged_attention: decode tokens first, then the prefill chunks */
        if (num_decode > 0) paged_attention(s, i, 0, num_decode, qkv, qkv_n, attn, attn_n);
        if (m > num_decode)
            prefill_attention(s, i, num_decode, m - num_decode, qkv, qkv_n, attn + esz * num_decode * attn_n, attn_n);
        if ((rc = linear(&L->o, attn, m, o, bf16))) break;
        add_norm(h, o, L->post_norm, x, m, hidden, eps, bf16);
        if ((rc = linear(&L->gate_up, x, m, gu, bf16))) break;
        if (bf16) silu_mul_bf16((const uint16_t *)gu, (uint16_t *)act, m, inter);
        else silu_mul_f32((const float *)gu, (float *)act, m, inter);
        if ((rc = linear(&L->down, act, m, down, bf16))) break;
        if (i + 1 < num_layers) {
            add_norm(h, down, layers[i + 1].input_norm, x, m, hidden, eps, bf16);
        } else if (bf16) { /* the last layer: h += down, in fp32 (the final norm is the caller's) */
            for (int64_t j = 0; j < (int64_t)m * hidden; j++) h[j] += bf16_to_f32(((const uint16_t *)down)[j]);
        } else {
            for (int64_t j = 0; j < (int64_t)m * hidden; j++) h[j] += ((const float *)down)[j];
        }
    }
    free(qkv);
    return rc;
}
