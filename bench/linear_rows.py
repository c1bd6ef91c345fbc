"""The model's linear layers timed at a given number of activation rows (bench.quant_engine's
`--linear-rows`): where a quantized tier's batch and prefill time goes against bf16's.

One pass calls every layer's four linears (qkv, o, gate_up, down) in order, each on its own
random bf16 (or the engine dtype's) input of `rows` rows, as a step of that many tokens would;
the caches are flushed before each pass (a step reads the whole model), and the figure is the
median pass. Beside it, for a quantized weight-only scheme whose bf16 batches take the bf16 GEMM
path (engine/qlinear.py, `BF16_GEMM_MIN_ROWS` rows or more): that path forced at one row, which is
its per-call dequantization of every weight into bf16 panels and nearly nothing else — the cost a
batch of 16+ rows pays on top of the GEMM that bf16's prepacked weights run directly.

Invariant: timing only; no figure here is compared against a bound in a test.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

#: bytes written between passes so that no weight is still in the caches (larger than any L3 here)
_FLUSH_BYTES = 64 << 20


def _linears(eng) -> list[Any]:
    return [
        getattr(layer, k)
        for layer in eng.runner.model.layers
        for k in ("qkv", "o", "gate_up", "down")
    ]


def _in_features(lin) -> int:
    return lin.in_features if hasattr(lin, "in_features") else lin.weight.shape[1]


def _median_ms(fn, reps: int) -> float:
    import torch

    flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8)
    fn()  # warm: first-call allocations, lazily packed weights
    times = []
    for _ in range(reps):
        flush.add_(1)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def time_linears(eng, rows: list[int], reps: int, seed: int = 0) -> dict[str, Any]:
    """{"rows_<n>_ms": median ms of one pass over every linear at n rows, ...,
    "panel_dequant_ms": the bf16 GEMM path's dequantization (None where the scheme does not take
    that path)}."""
    import torch

    from engine.qlinear import QLinear

    lins = _linears(eng)
    g = torch.Generator().manual_seed(seed)
    dtype = eng.dtype
    out: dict[str, Any] = {}
    for n in rows:
        xs = [torch.randn(n, _in_features(lin), generator=g).to(dtype) for lin in lins]

        def one_pass(xs=xs) -> None:
            for lin, x in zip(lins, xs, strict=True):
                lin(x)

        out[f"rows_{n}_ms"] = _median_ms(one_pass, reps)
    gemm = [
        lin for lin in lins if isinstance(lin, QLinear) and lin.w8 is None and lin.bf16_min_rows > 0
    ]
    if dtype != torch.bfloat16 or len(gemm) != len(lins):
        out["panel_dequant_ms"] = None
        return out
    xs = [torch.randn(1, lin.in_features, generator=g).to(dtype) for lin in gemm]
    outs = [torch.empty(1, lin.out_features, dtype=dtype) for lin in gemm]

    def dequant_pass() -> None:
        for lin, x, o in zip(gemm, xs, outs, strict=True):
            bias = 0 if lin.bias is None else lin.bias.data_ptr()
            if lin._bf16_gemm(x, 1, lin.in_features, bias, o, 0) != 0:
                raise RuntimeError("the bf16 GEMM path refused a one-row call")

    out["panel_dequant_ms"] = _median_ms(dequant_pass, reps)
    return out
