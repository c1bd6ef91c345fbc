"""`python -m bench.probes.linear_bf16_vs_onednn`: one bf16 linear on linear_bf16.c against oneDNN's
prepacked call, SmolLM2's four shapes, 1 to 512 rows, in one process.

Eight copies of each weight are called in turn, so a decode-sized call reads weights that are not
all in cache (as 30 layers do). Prints each time (best of 5 rounds), oneDNN's over linear_bf16's
(> 1: linear_bf16 faster) and the largest difference between the two outputs."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from engine.kernels import kernels_lib

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 2, 4, 6, 8, 16, 32, 64, 128, 512)
COPIES = 8


def _best(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def _onednn_all(x: torch.Tensor, packed: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.ops.mkldnn._linear_pointwise(x, q, None, "none", [], "") for q in packed]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--isa", type=int, default=0, help="linear_bf16's path: 0 best, 1 vdpbf16ps, 2 AMX"
    )
    args = p.parse_args()
    lib = kernels_lib()
    if lib is None or lib.qgemm_bf16_isa() < 1:
        raise SystemExit("linear_bf16 is not built on this CPU (it needs AVX-512 BF16)")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)

    def pack(w: torch.Tensor) -> torch.Tensor:
        panels = torch.empty(lib.linear_bf16_packed_words(*w.shape), dtype=torch.int32)
        if lib.linear_bf16_pack(w.data_ptr(), w.shape[0], w.shape[1], panels.data_ptr()) != 0:
            raise SystemExit("linear_bf16_pack failed")
        return panels

    def own(x: torch.Tensor, panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
        out = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
        rc = lib.linear_bf16(
            x.data_ptr(),
            k,
            x.shape[0],
            k,
            panels.data_ptr(),
            n,
            None,
            out.data_ptr(),
            n,
            0,
            args.isa,
        )
        if rc != 0:
            raise SystemExit(f"linear_bf16 failed ({rc})")
        return out

    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, generator=g).bfloat16() for _ in range(COPIES)]
        panels = [pack(w) for w in ws]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch_size=32) for w in ws]
        for m in ROWS:
            x = torch.randn(m, k, generator=g).bfloat16()
            reps = max(1, 2000 // m) // COPIES + 1
            onednn = _best(functools.partial(_onednn_all, x, packed), reps) / COPIES
            mine = (
                _best(
                    functools.partial(
                        lambda x, ps, n, k: [own(x, pn, n, k) for pn in ps], x, panels, n, k
                    ),
                    reps,
                )
                / COPIES
            )
            ref = torch.ops.mkldnn._linear_pointwise(x, packed[0], None, "none", [], "")
            diff = (own(x, panels[0], n, k).float() - ref.float()).abs().max().item()
            print(
                f"{name:8s} m={m:4d} onednn {onednn * 1e6:9.1f} us  linear_bf16 {mine * 1e6:9.1f} "
                f"us  onednn/own {onednn / mine:5.2f}  max diff {diff:.3g}",
                flush=True,
            )


if __name__ == "__main__":
    main()
