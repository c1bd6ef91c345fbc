"""`python -m bench.probes.w8a8_ab OLD.so`: the W8A8 kernel (`qlinear_w8a8`) of another build of
the kernels against this checkout's, in one process, on int8-w8a8 SmolLM2's layer-3 linears.

Both libraries run the same packed weights and inputs, alternating, best of 12 rounds; prints each
time, their ratio (> 1: this checkout faster) and whether the outputs are bitwise equal. OLD.so is
a `$DUET_HOME/kernels/duet_kernels-*.so` built from another revision (import engine.kernels in
that revision's tree to build it)."""

from __future__ import annotations

import argparse
import ctypes
import time
from typing import Any

import torch

from bench.engine_tiers import _engine, parse_args


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("old", help="path of the other build's kernel library")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="512,64,8,1")
    args = p.parse_args()
    eng = _engine(parse_args(["--threads", str(args.threads)]), "int8-w8a8")
    torch.set_num_threads(args.threads)
    layer = eng.runner.model.layers[3]
    new = layer.qkv.lib
    old = ctypes.CDLL(args.old)
    old.qlinear_w8a8.argtypes, old.qlinear_w8a8.restype = (
        new.qlinear_w8a8.argtypes,
        new.qlinear_w8a8.restype,
    )
    g = torch.Generator().manual_seed(0)
    for name in ("qkv", "o", "gate_up", "down"):
        f = getattr(layer, name)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, f.in_features, generator=g).bfloat16()
            outs: dict[str, torch.Tensor] = {}

            def run(
                lib: ctypes.CDLL,
                key: str,
                x: torch.Tensor = x,
                f: Any = f,
                m: int = m,
                outs: dict[str, torch.Tensor] = outs,
            ) -> None:
                out = torch.empty((m, f.out_features), dtype=torch.bfloat16)
                rc = lib.qlinear_w8a8(
                    x.data_ptr(),
                    x.stride(0),
                    m,
                    f.in_features,
                    *f.w8_args,
                    f.out_features,
                    0,
                    out.data_ptr(),
                    out.stride(0),
                    1,
                    0,
                    f.act_group,
                )
                if rc != 0:
                    raise SystemExit(f"qlinear_w8a8 failed ({rc})")
                outs[key] = out

            best = {"old": float("inf"), "new": float("inf")}
            reps = max(2, 4096 // m)
            for _ in range(12):
                for key, lib in (("old", old), ("new", new)):
                    t = time.perf_counter()
                    for _ in range(reps):
                        run(lib, key)
                    best[key] = min(best[key], (time.perf_counter() - t) / reps)
            print(
                f"{name:8s} m={m:4d} old {best['old'] * 1e6:8.1f} us  new {best['new'] * 1e6:8.1f} "
                f"us  old/new {best['old'] / best['new']:.3f}  equal "
                f"{torch.equal(outs['old'], outs['new'])}",
                flush=True,
            )


if __name__ == "__main__":
    main()
