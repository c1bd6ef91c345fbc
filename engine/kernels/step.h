/*
 * The per-step arguments the kernels share, built once per step by the runner (engine/
 * kernel_step.py mirrors this struct with ctypes) so a per-layer call passes a pointer and a
 * few data pointers instead of ~20 converted arguments.
 *
 * Token t of the step sits at position positions[t] of the sequence whose block table is row
 * token_row[t] of block_tables; it attends to keys [max(0, ctx_lens[t] - window), ctx_lens[t])
 * (window 0: no sliding window) and its new K/V go to slot (slot_block[t], slot_offset[t]).
 * Pool layout (elements): [num_blocks][layers][2][block_size][num_kv_heads][head_dim]; an int8
 * pool's rows are head_dim int8 values and then their fp32 scale's 4 bytes (row width head_dim + 4
 * bytes, engine/kv_quant.py), its strides in bytes.
 */
#ifndef DUET_KERNELS_STEP_H
#define DUET_KERNELS_STEP_H

#include <stdint.h>

typedef struct {
    void *cache;
    int64_t layer_stride; /* elements between consecutive layers of a block */
    int64_t block_stride; /* elements between consecutive blocks */
    const int64_t *block_tables; /* [rows][table_width] */
    int64_t table_width;
    const int32_t *token_row;
    const int32_t *ctx_lens;
    const int64_t *positions;
    const int64_t *slot_block;
    const int64_t *slot_offset;
    const void *cos; /* [max_positions][head_dim], model dtype */
    const void *sin;
    int32_t num_tokens;
    int32_t num_heads;
    int32_t num_kv_heads;
    int32_t head_dim;
    int32_t block_size;
    int32_t window;
    int32_t max_ctx; /* max of ctx_lens over the tokens a call may see */
    int32_t bf16; /* 1: activations and tables are bf16 (and the pool, unless kv_int8); 0: fp32 */
    float scale;
    int32_t kv_int8; /* 1: the pool holds int8 rows with their scale (attention_int8.h) */
} Step;

#endif
