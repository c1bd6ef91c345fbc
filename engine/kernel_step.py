"""The kernels' per-step argument block: a ctypes mirror of `Step` in engine/kernels/step.h.

Built once per step from the step's metadata tensors; every layer then passes one pointer.
Invariant: the tensors whose addresses the struct holds are kept referenced by `KernelStep`
for as long as it lives (the struct itself holds raw pointers only).
"""

from __future__ import annotations

import ctypes

import torch

from engine import kv_quant


class StepStruct(ctypes.Structure):
    _fields_ = [
        ("cache", ctypes.c_void_p),
        ("layer_stride", ctypes.c_int64),
        ("block_stride", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p),
        ("table_width", ctypes.c_int64),
        ("token_row", ctypes.c_void_p),
        ("ctx_lens", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("slot_block", ctypes.c_void_p),
        ("slot_offset", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("max_ctx", ctypes.c_int32),
        ("bf16", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("kv_int8", ctypes.c_int32),
    ]


class KernelStep:
    """A filled `Step` plus the tensors it points into; `ptr` is what the kernels take."""

    def __init__(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, layers, 2, block_size, KVH, D (+ 4: int8)]
        block_tables: torch.Tensor,  # [rows, width] int64
        token_row: torch.Tensor,  # [T] int32
        ctx_lens: torch.Tensor,  # [T] int32
        positions: torch.Tensor,  # [T] int64
        slot_block: torch.Tensor,  # [T] int64
        slot_offset: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [max_positions, D] model dtype
        sin: torch.Tensor,
        num_heads: int,
        max_ctx: int,
        window: int | None,
    ) -> None:
        self._keep = (
            kv_cache,
            block_tables,
            token_row,
            ctx_lens,
            positions,
            slot_block,
            slot_offset,
            cos,
            sin,
        )
        _, _, _, bs, kvh, _ = kv_cache.shape
        # an int8 pool's rows carry their scale past head_dim; the activations' dtype is cos's
        int8 = kv_quant.is_quantized(kv_cache)
        dim = kv_quant.head_dim(kv_cache)
        bf16 = (cos if int8 else kv_cache).dtype == torch.bfloat16
        self.struct = StepStruct(
            kv_cache.data_ptr(),
            kv_cache.stride(1),
            kv_cache.stride(0),
            block_tables.data_ptr(),
            block_tables.shape[1],
            token_row.data_ptr(),
            ctx_lens.data_ptr(),
            positions.data_ptr(),
            slot_block.data_ptr(),
            slot_offset.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            positions.shape[0],
            num_heads,
            kvh,
            dim,
            bs,
            window or 0,
            max_ctx,
            int(bf16),
            dim**-0.5,
            int(int8),
        )
        self.ptr = ctypes.addressof(self.struct)
