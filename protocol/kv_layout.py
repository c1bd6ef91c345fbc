"""The KV-cache layout contract between a node's engine and the transport (DESIGN.md §3, §4).

A pool is block-major `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, so
block `b` is the one contiguous byte range `[b * block_bytes, (b + 1) * block_bytes)` of the
pool: one memory region, one NIXL descriptor. Two nodes may exchange blocks only when every
field but `num_blocks` matches; `compat_hash` summarises those fields and `differences` names
the ones that differ, so a refusal can say why before any byte moves.

An 8-bit pool (`dtype="int8"`) keeps each token's K (or V) of one KV head as `head_dim` int8
values followed by their fp32 scale (absmax / 127, little-endian): a row is `head_dim + 4`
bytes, and the scales travel, spill and are digested with the block's bytes. `dtype` is in the
hash, so an int8 pool never exchanges blocks with a bf16 one.
"""

from __future__ import annotations

import hashlib

import msgspec

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
#: bytes of the per-row scale that follows each row of a quantized pool, by KV dtype
SCALE_BYTES = {"int8": 4}


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_blocks: int  # capacity of this pool; not part of compatibility
    #: how the engine arranges its pool: "block-major" (the native engine, above) or another
    #: engine's own ("vllm"); pools of different layouts never exchange blocks
    layout: str = "block-major"
    #: the weights' quantization the KV was computed with ("" = the model's own weights): KV of
    #: an int4 prefill in a bf16 decode would silently mix numerics, so it is part of the hash
    weights: str = ""
    #: what reads the KV besides its shape, for architectures past the Llama family: the model
    #: type and, where layers differ, each layer's attention ("gemma2;window=4096;layers=sfsf…":
    #: s a sliding-window layer, f a full one). "" (the Llama family) stays out of the hash
    attention: str = ""

    @property
    def itemsize(self) -> int:
        try:
            return DTYPE_SIZES[self.dtype]
        except KeyError:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}") from None

    @property
    def row_width(self) -> int:
        """Elements of the pool's last dimension: `head_dim`, plus the scale's bytes in an 8-bit
        pool (whose elements are bytes)."""
        return self.head_dim + SCALE_BYTES.get(self.dtype, 0)

    @property
    def block_bytes(self) -> int:
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.row_width
            * self.itemsize
        )

    @property
    def pool_shape(self) -> tuple[int, int, int, int, int, int]:
        """The pool tensor's shape: `[num_blocks, layers, 2, block_size, kv_heads, row_width]`."""
        return (
            self.num_blocks,
            self.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            self.row_width,
        )

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def block_offset(self, block_id: int) -> int:
        """Byte offset of `block_id` in the pool; raises on an id outside the pool."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return block_id * self.block_bytes

    def _compat_fields(self) -> tuple[tuple[str, object], ...]:
        return (
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("block_size", self.block_size),
            ("dtype", self.dtype),
            # Only a non-default layout enters the hash, so native hashes stay what they were.
            *((("layout", self.layout),) if self.layout != "block-major" else ()),
            *((("weights", self.weights),) if self.weights else ()),
            *((("attention", self.attention),) if self.attention else ()),
        )

    @property
    def compat_hash(self) -> str:
        text = ";".join(f"{k}={v}" for k, v in self._compat_fields())
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def differences(self, other: KVLayout) -> list[str]:
        """Human-readable list of the compatibility fields that differ (empty: compatible)."""
        mine, theirs = dict(self._compat_fields()), dict(other._compat_fields())
        mine.setdefault("layout", self.layout)
        theirs.setdefault("layout", other.layout)
        mine.setdefault("weights", self.weights or "unquantized")
        theirs.setdefault("weights", other.weights or "unquantized")
        mine.setdefault("attention", self.attention or "llama")
        theirs.setdefault("attention", other.attention or "llama")
        return [f"{k}: {a} != {theirs[k]}" for k, a in mine.items() if a != theirs[k]]
