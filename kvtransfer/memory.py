"""The registered KV pool as raw memory: base address, size, device, and views into it.

The engine owns the pool (a torch tensor); a transport only needs where it lives. A pool is
given either as a base address (int) plus device, or as a contiguous tensor, which is then
kept referenced so its memory cannot be freed while registered. Invariant: `nbytes` covers
at least `layout.pool_bytes`, so every in-range block id maps inside the allocation.

Host pools are advised to use transparent huge pages at registration: on one host the NIXL
data path is a kernel copy between processes (UCX `cma`, process_vm_readv), which walks and
pins every page of both sides per call; with 2 MiB pages 64-256 block reads measured ~40%
faster (60-77% → 95-105% of memcpy, bench/kvtransfer.py --sweep-ucx). `allocate_pool`
hands out a pool that has them from the first touch.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvtransfer.errors import BackendUnavailable, TransferError
from protocol.kv_layout import KVLayout

log = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux ≥ 6.1; older kernels answer EINVAL, which is fine


def parse_device(device: str) -> tuple[str, int]:
    """ "cpu" → ("cpu", 0); "cuda" / "cuda:N" → ("cuda", N)."""
    if device == "cpu":
        return "cpu", 0
    if device == "cuda":
        return "cuda", 0
    kind, _, index = device.partition(":")
    if kind == "cuda" and index.isdigit():
        return "cuda", int(index)
    raise TransferError(f"unsupported pool device {device!r}; expected 'cpu' or 'cuda:N'")


class _CudaView:
    """A device byte range exposed through `__cuda_array_interface__` (for ucxx)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


@dataclass(frozen=True)
class PoolMemory:
    base: int
    nbytes: int
    device: str  # normalised: "cpu" or "cuda:N"
    layout: KVLayout
    owner: Any = field(default=None, repr=False, compare=False)  # keeps a tensor alive

    @property
    def is_cuda(self) -> bool:
        return self.device != "cpu"

    @property
    def device_index(self) -> int:
        return parse_device(self.device)[1]

    def host_view(self) -> memoryview:
        """A writable byte view of the whole host pool (no copy)."""
        if self.is_cuda:
            raise BackendUnavailable(f"pool on {self.device} has no host view")
        buf = (ctypes.c_ubyte * self.nbytes).from_address(self.base)
        return memoryview(buf).cast("B")

    def region(self, offset: int, length: int) -> Any:
        """Zero-copy view of `[offset, offset + length)`: memoryview on host, CUDA array on GPU."""
        if offset < 0 or offset + length > self.nbytes:
            raise TransferError(f"region [{offset}, {offset + length}) outside the pool")
        if self.is_cuda:
            return _CudaView(self.base + offset, length)
        return self.host_view()[offset : offset + length]


@runtime_checkable
class PoolTensor(Protocol):
    """What a pool given as a tensor must offer (a torch.Tensor does; kvtransfer never imports
    torch, so the tensor is described by what is read from it)."""

    @property
    def device(self) -> Any: ...  # a torch.device: `.type` ("cpu", "cuda") and `.index`

    def data_ptr(self) -> int: ...

    def is_contiguous(self) -> bool: ...

    def numel(self) -> int: ...

    def element_size(self) -> int: ...


def describe_pool(
    pool: int | PoolTensor, layout: KVLayout, device: str | None = None
) -> PoolMemory:
    """Normalise `pool` (base address or contiguous tensor) into a `PoolMemory`."""
    owner: PoolTensor | None = None
    if isinstance(pool, int) and not isinstance(pool, bool):
        base, nbytes = pool, layout.pool_bytes
        device = device or "cpu"
    elif isinstance(pool, PoolTensor):
        if not pool.is_contiguous():
            raise TransferError("pool tensor must be contiguous (one block = one byte range)")
        tdev = "cpu" if pool.device.type == "cpu" else f"cuda:{pool.device.index or 0}"
        if device is not None and parse_device(device) != parse_device(tdev):
            raise TransferError(f"pool tensor lives on {tdev}, not on {device}")
        base, nbytes, device, owner = (
            pool.data_ptr(),
            pool.numel() * pool.element_size(),
            tdev,
            pool,
        )
    else:
        raise TransferError(f"pool must be a base address (int) or a tensor, not {type(pool)}")
    kind, index = parse_device(device)
    norm = "cpu" if kind == "cpu" else f"cuda:{index}"
    if base <= 0:
        raise TransferError(f"pool base address {base:#x} is not a valid pointer")
    if nbytes < layout.pool_bytes:
        raise TransferError(
            f"pool holds {nbytes} bytes but its layout needs {layout.pool_bytes} "
            f"({layout.num_blocks} blocks of {layout.block_bytes} B)"
        )
    return PoolMemory(base=base, nbytes=nbytes, device=norm, layout=layout, owner=owner)


def advise_hugepages(base: int, nbytes: int, *, collapse: bool = True) -> int:
    """Best effort: back `[base, base + nbytes)` with 2 MiB pages; returns bytes advised.

    MADV_HUGEPAGE makes future faults huge; MADV_COLLAPSE also converts pages already
    touched (synchronously, ~0.3 s per 100 MB here). Failures are only logged: the
    memory stays correct, merely slower to transfer.
    """
    start = (base + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    end = (base + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    if madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        log.debug("MADV_HUGEPAGE failed: errno %d", ctypes.get_errno())
        return 0
    if collapse:
        t0 = time.perf_counter()
        if madvise(start, end - start, _MADV_COLLAPSE) != 0:
            log.debug("MADV_COLLAPSE failed: errno %d", ctypes.get_errno())
        elapsed = time.perf_counter() - t0
        if elapsed > 1.0:
            log.info(
                "backed %d MiB of KV pool with huge pages in %.1f s", (end - start) >> 20, elapsed
            )
    return end - start


def allocate_pool(layout: KVLayout, device: str = "cpu", dtype: Any = None) -> Any:
    """A zeroed, contiguous torch pool `layout.pool_shape`
    (`[num_blocks, num_layers, 2, block_size, heads, dim]`, dim + 4 scale bytes in int8).

    On the host it is huge-page backed from the first touch, which no later advice can do
    as cheaply. `dtype` defaults to the layout's dtype.
    """
    import torch  # the engine's dependency; the transport itself works from addresses

    dt = dtype or getattr(torch, layout.dtype)
    shape = layout.pool_shape  # an 8-bit pool's rows end with their scales
    if parse_device(device)[0] == "cuda":
        return torch.zeros(shape, dtype=dt, device=device)
    pool = torch.empty(shape, dtype=dt)  # untouched: the advice below applies to every page
    advise_hugepages(pool.data_ptr(), pool.numel() * pool.element_size(), collapse=False)
    pool.zero_()
    return pool
