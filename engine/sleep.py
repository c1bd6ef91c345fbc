"""Sleep mode (vLLM's): an idle engine gives its memory back and keeps everything else.

Asleep, the model's weights are dropped (the runner's model and a draft model's: rebuilt from
the model directory on wake, where the OS's page cache and the quantized cache make the reload
the whole cost), and the KV pool's pages go back to the OS (`release_pages`: madvise
MADV_DONTNEED on the host pool). The pool keeps its address, so the transport's registration of
it (NIXL) stays valid across sleep and wake: the pages fault back in, zeroed, when written. The
prefix cache is cleared first (its blocks' contents are gone; the coordinator sees
AllBlocksCleared), LoRA adapters stay resident (their slots are small) and are applied to the
rebuilt model. On CUDA the pool cannot be released this way and is kept (the weights still go).

An engine sleeps only when it holds no request (queued, running or held for a transfer);
`wake` is what the next request or embedding triggers, or an explicit call. Invariant: while
asleep, `runner.model` is None and nothing is scheduled.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.runner import ModelRunner

log = logging.getLogger("duet.engine")
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


class EngineBusy(RuntimeError):
    """Sleep asked of an engine that holds requests."""


@dataclass(frozen=True)
class SleepReport:
    #: bytes of weights the dropped model(s) held (their decode_weight_bytes)
    weight_bytes: int
    #: bytes of KV pool pages given back to the OS
    kv_bytes_released: int
    seconds: float


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The page-aligned interior [start, end) of a host tensor's bytes."""
    base = t.data_ptr()
    start = -(-base // _PAGE) * _PAGE
    end = (base + t.numel() * t.element_size()) // _PAGE * _PAGE
    return start, max(start, end)


def release_pages(t: torch.Tensor) -> int:
    """Give a host tensor's whole pages back to the OS (they read as zeros afterwards);
    returns the bytes released (0 on CUDA, or when the kernel refuses)."""
    if t.device.type != "cpu":
        return 0
    start, end = _span(t)
    if end <= start:
        return 0
    libc = _libc()
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, _MADV_DONTNEED) != 0:
        log.warning("madvise(MADV_DONTNEED) on the KV pool failed: errno %d", ctypes.get_errno())
        return 0
    return end - start


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of a host tensor's whole pages that are in memory now (mincore)."""
    start, end = _span(t)
    pages = (end - start) // _PAGE
    if pages <= 0:
        return 0
    vec = (ctypes.c_ubyte * pages)()
    libc = _libc()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(start, end - start, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * _PAGE


def drop_model(runner: ModelRunner) -> int:
    """Drop a runner's model (its weights); returns their bytes (what a decode step reads: every
    linear, norm and the head)."""
    n = runner.model.decode_weight_bytes()
    runner.model = None
    gc.collect()
    return n


def rebuild_model(runner: ModelRunner) -> None:
    """Build the runner's model again from its BuildSpec (and re-attach its LoRA slots)."""
    from engine.models import build_model

    runner.model = build_model(runner.build_spec)
    if runner.kv_layout.dtype == "int8":
        from engine.kv_quant import kv_int8_pool

        kv_int8_pool(runner.model)
    lora = getattr(runner, "lora", None)
    if lora is not None:
        lora.attach(runner.model)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
