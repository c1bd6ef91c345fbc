/*
 * The layers of a pure-decode step of a bf16 engine over quantized weights (or bf16 weights on
 * linear_bf16.c), in one call.
 *
 * engine/model.py runs each layer as ~9 Python calls (qkv, rope_store, paged_attention, o, the
 * residual norm, gate_up, SiLU·up, down, the next residual norm), each converting its arguments
 * and allocating its output tensor. A single-stream decode step of a small model is bound by
 * memory bandwidth, so those microseconds are a fixed cost per layer that the GEMVs do not hide
 * (SmolLM2-135M int8, 30 layers: about a fifth of the step at one thread). This file runs the same
 * kernels, in the same order, on the same buffers' values, from C: the step's result is bitwise
 * the one of the Python loop (tests/engine/test_decode_layers.py), only without the round trips.
 *
 * Scope (the caller, LlamaModel.hidden_states, checks it): fewer than BF16_GEMM_MIN_ROWS tokens in
 * the step (so each linear takes the same kernel the Python QLinear would: the GEMV/tile path, or
 * W8A8) — decode tokens, and prefill tokens too where the model runs prefill attention on the
 * kernels (a speculative verification's k + 1 tokens, a draft's catch-up feed, a short prompt's
 * chunk); bf16 activations with the fp32 residual stream;
 * every linear quantized (int8/int4 weight-only or W8A8) or a bf16 weight in linear_bf16.c's
 * panels (CPUs with AVX-512 BF16); no q/k norms.
 *
 * In: h, the fp32 residual stream [m][hidden] (updated in place); x, bf16 [m][hidden], the first
 * layer's normed input. Out: h after the last layer (its down projection added, not normed).
 * Returns 0, -1 when out of memory, or a linear kernel's error code.
 */
#include <stdint.h>
#include <stdlib.h>

#include "step.h"

enum { DEC_INT8 = 1, DEC_INT4 = 2, DEC_W8A8 = 3, DEC_W4A8 = 4, DEC_BF16 = 5 };

/* One linear as QLinear (or, DEC_BF16, engine/linear.py's Linear) calls it (engine/decode_plan.py
 * builds these). DEC_W4A8 is int4-w4a8: the int4 weight-only GEMV for one row (it reads half the
 * bytes), W8A8 for more. DEC_BF16: a bf16 weight in linear_bf16.c's panels (q). */
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
    const void *bias; /* bf16 [n] or NULL */
} DecLinear;

typedef struct {
    const uint16_t *input_norm;
    const uint16_t *post_norm;
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

/* out [m][L->n] (bf16, rows contiguous) = x [m][L->k] @ W^T + bias, as QLinear._kernel (or
 * Linear._own) picks. */
static int32_t linear(const DecLinear *L, const uint16_t *x, int32_t m, uint16_t *out) {
    const int kind = L->kind == DEC_W4A8 ? (m == 1 ? DEC_INT4 : DEC_W8A8) : L->kind;
    switch (kind) {
    case DEC_INT8:
        return qlinear_int8(x, L->k, m, L->k, L->q, L->scales, L->n, L->bias, out, L->n, 1, 0);
    case DEC_INT4:
        return qlinear_int4(x, L->k, m, L->k, L->q, L->scales, L->mins, L->group, L->n, L->bias, out, L->n, 1, 0);
    case DEC_W8A8:
        return qlinear_w8a8(x, L->k, m, L->k, L->wp, L->wscale, L->wsum, L->n, L->bias, out, L->n, 1, 0,
                            L->act_group);
    case DEC_BF16:
        return linear_bf16(x, L->k, m, L->k, L->q, L->n, L->bias, out, L->n, 0, 0);
    default:
        return -3;
    }
}

int32_t decode_layers(const Step *s, const DecLayer *layers, int32_t num_layers, float *h, uint16_t *x, int32_t m,
                      int32_t num_decode, int32_t hidden, int32_t inter, float eps) {
    const int64_t qkv_n = layers[0].qkv.n, attn_n = (int64_t)s->num_heads * s->head_dim;
    /* one allocation for the layer's intermediates (bf16), reused by every layer */
    uint16_t *qkv = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)m *
                                       (size_t)(qkv_n + attn_n + hidden + 2 * (int64_t)inter + inter + hidden));
    if (!qkv) return -1;
    uint16_t *attn = qkv + (int64_t)m * qkv_n, *o = attn + (int64_t)m * attn_n, *gu = o + (int64_t)m * hidden;
    uint16_t *act = gu + (int64_t)m * 2 * inter, *down = act + (int64_t)m * inter;
    int32_t rc = 0;
    for (int i = 0; i < num_layers && rc == 0; i++) {
        const DecLayer *L = layers + i;
        if ((rc = linear(&L->qkv, x, m, qkv))) break;
        rope_store(s, i, qkv, qkv_n);
        /* as engine/attention.py's paged_attention: decode tokens first, then the prefill chunks */
        if (num_decode > 0) paged_attention(s, i, 0, num_decode, qkv, qkv_n, attn, attn_n);
        if (m > num_decode) prefill_attention(s, i, num_decode, m - num_decode, qkv, qkv_n, attn + (int64_t)num_decode * attn_n, attn_n);
        if ((rc = linear(&L->o, attn, m, o))) break;
        res_norm_f32(h, o, L->post_norm, x, m, hidden, eps, 0);
        if ((rc = linear(&L->gate_up, x, m, gu))) break;
        silu_mul_bf16(gu, act, m, inter);
        if ((rc = linear(&L->down, act, m, down))) break;
        if (i + 1 < num_layers) {
            res_norm_f32(h, down, layers[i + 1].input_norm, x, m, hidden, eps, 0);
        } else { /* the last layer: h += down, in fp32 (the final norm is the caller's) */
            for (int64_t j = 0; j < (int64_t)m * hidden; j++) {
                union { uint32_t u; float f; } v = {.u = (uint32_t)down[j] << 16};
                h[j] += v.f;
            }
        }
    }
    free(qkv);
    return rc;
}
