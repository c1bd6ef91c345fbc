"""`python -m bench.probes.decode_linears`: where a single-stream decode step's linears go, per
weight scheme — SmolLM2-135M's 30 layers of one-row linears (qkv, o, gate_up, down, each layer its
own random weight so nothing stays in cache between steps, as in a real step) and its lm_head, on
the kernels a W2 decode step calls (QLinear; bf16 on linear_bf16.c where the CPU has AVX-512 BF16).

Prints, per scheme and matrix kind, its time in the fastest of `--rounds` steps, the bytes it reads
and the rate, and the ceiling on tokens/s if a step were nothing but these linears: compared with
`bench.engine_tiers`' W2 figure of the same run, it says how much of a decode step is the linears
and how much is everything else (attention, norms, sampling, the engine loop)."""

from __future__ import annotations

import argparse
import copy
import ctypes
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.linear import Linear
from engine.logits_head import LogitsHead
from engine.qlinear import QLinear
from engine.quant import LM_HEAD_SCHEME, quantize

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)


def _layer(w: torch.Tensor, scheme: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """A one-row callable of weight `w` in `scheme`, and the bytes one call reads."""
    lin = Linear(w.bfloat16()) if scheme == "none" else QLinear(quantize(w, scheme))
    return lin, lin.decode_bytes


def _head(w: torch.Tensor, scheme: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """The lm_head (fp32 logits) as the engine builds it: bf16, or LM_HEAD_SCHEME's int8."""
    head = LogitsHead(w.bfloat16() if scheme == "none" else quantize(w, LM_HEAD_SCHEME[scheme]))
    return head, head.decode_bytes


def _other_lib(path: str) -> ctypes.CDLL:
    from engine.kernels import kernels_lib

    mine, lib = kernels_lib(), ctypes.CDLL(path)
    assert mine is not None, "the kernels are not built here"
    for name in ("qlinear_int8", "qlinear_int4", "qlinear_w8a8"):
        fn, ref = getattr(lib, name), getattr(mine, name)
        fn.argtypes, fn.restype = ref.argtypes, ref.restype
    return lib


def _on(fn: Any, lib: ctypes.CDLL) -> Any:
    """A copy of `fn` (a QLinear, or a LogitsHead over one) calling `lib`'s kernels."""
    fn = copy.copy(fn)
    if getattr(fn, "q", None) is not None:  # LogitsHead
        fn.q = _on(fn.q, lib)
    else:
        fn.lib = lib
    return fn


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--schemes", default="none,int8,int4", help="comma-separated: none (bf16), int8, int4"
    )
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument(
        "--against",
        metavar="OLD.so",
        help="also run each quantized scheme on another build of the "
        "kernels (a $DUET_HOME/kernels/duet_kernels-*.so of another revision), steps alternating",
    )
    args = p.parse_args()
    other = _other_lib(args.against) if args.against else None
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    for scheme in args.schemes.split(","):
        kinds: dict[str, list[tuple[Callable[[torch.Tensor], torch.Tensor], int, int]]] = {}
        for name, (n, k) in SHAPES.items():
            kinds[name] = [
                (*_layer(torch.randn(n, k, generator=g) * 0.05, scheme), k) for _ in range(LAYERS)
            ]
        kinds["lm_head"] = [(*_head(torch.randn(*LM_HEAD, generator=g) * 0.05, scheme), LM_HEAD[1])]
        xs = {k: torch.randn(1, k, generator=g).bfloat16() for k in {576, 1536}}
        # one step in a decode step's order (layer by layer, then the lm_head): the ~95-270 MB it
        # reads do not fit in L3, as in a real step; each call timed, the best of `rounds` steps
        # kept
        order = [(name, *kinds[name][i]) for i in range(LAYERS) for name in SHAPES] + [
            ("lm_head", *kinds["lm_head"][0])
        ]
        runs = {scheme: order}
        if other is not None and scheme != "none":
            runs[f"{scheme}@old"] = [(name, _on(fn, other), b, k) for name, fn, b, k in order]
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds + 1):
            for (
                label,
                steps,
            ) in runs.items():  # alternating: both see the same moments of the machine
                spent = dict.fromkeys(kinds, 0.0)
                for name, fn, _, k in steps:
                    t = time.perf_counter()
                    fn(xs[k])
                    spent[name] += time.perf_counter() - t
                if label not in best or sum(spent.values()) < sum(best[label].values()):
                    best[label] = spent
        for label, spent in best.items():
            for name, layers in kinds.items():
                t, nbytes = spent[name], sum(b for _, b, _ in layers)
                print(
                    f"{label:9s} {name:8s} {t * 1e3:7.3f} ms/step  {nbytes / 1e6:7.2f} MB  "
                    f"{nbytes / t / 1e9:6.2f} GB/s",
                    flush=True,
                )
            total_t, total_b = (
                sum(spent.values()),
                sum(b for layers in kinds.values() for _, b, _ in layers),
            )
            print(
                f"{label:9s} {'all':8s} {total_t * 1e3:7.3f} ms/step  {total_b / 1e6:7.2f} MB  "
                f"{total_b / total_t / 1e9:6.2f} GB/s  -> at most {1 / total_t:6.1f} tokens/s from "
                "the linears alone",
                flush=True,
            )


if __name__ == "__main__":
    main()
