"""`python -m bench.kernel_ab`: this checkout's CPU kernels against another revision's, in one
process, on the engine's own linear layers.

Why one process: on a shared 2-vCPU VM the same build's rates move 10-15 % from one minute to the
next, so two benchmark runs taken minutes apart cannot tell a 5 % kernel change from the machine.
Here both builds are loaded side by side (the other revision's `engine/kernels/` is taken with
`git archive`, compiled with the same flags into a private copy), and every pass alternates them
over the same inputs, flushing the caches before each, so drift moves both alike. The figure is
the median pass time of each build and their ratio.

One pass calls every layer's four linears (qkv, o, gate_up, down) at `rows` activation rows, as
a step of that many tokens would (bench/linear_rows.py), or with `--head` the lm_head on fp32 rows
(the logits of `rows` sequences), once with each build's library (`.lib`); the weights are loaded
and packed once, by this checkout. Beside the times, each
row says whether the two builds' outputs are bitwise identical: a speed change that was meant to
keep the arithmetic shows it did.

`--base HEAD` with an unchanged tree compares the build with a copy of itself: the harness's own
noise (ratios within ~2.5 % of 1 on a quiet machine).

Limits: both builds are called through this checkout's ctypes signatures, so a revision whose
kernel functions take other arguments cannot be compared; functions it lacks are left out (the
linears call only the quantized and bf16 GEMM entry points).
Progress on stderr; a table, or one JSON object with --json, on stdout. Exit code 2 when the
revision cannot be read or built.

Invariant: timing only; no figure here is compared against a bound in a test.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import engine_runs
from bench.flops import machine_info
from bench.linear_rows import _FLUSH_BYTES, _in_features, _linears

_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.kernel_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--base",
        default="HEAD",
        help="git revision whose engine/kernels/ is the baseline (default HEAD)",
    )
    ap.add_argument(
        "--base-dir",
        type=Path,
        default=None,
        help="a directory of kernel sources as the baseline instead of a revision (e.g. a variant "
        "being tried)",
    )
    ap.add_argument(
        "--base-march",
        default="native",
        help="gcc -march of the baseline build (default native): x86-64-v3 for the AVX2 paths, "
        "x86-64-v2 for the portable C, skylake-avx512 ...; with --base HEAD and an unchanged tree, "
        "this checkout's paths for two x86 levels against each other",
    )
    ap.add_argument(
        "--march",
        default="native",
        help="gcc -march of this checkout's build (default native: the engine's own library)",
    )
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model name or directory")
    ap.add_argument(
        "--schemes",
        default="none,int8,int4,int8-w8a8,int4-w4a8",
        help="comma-separated quantization schemes ('none': bf16)",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the engine's activation dtype: the linears' inputs (default %(default)s)",
    )
    ap.add_argument("--rows", default="1,8,32,512", help="comma-separated activation row counts")
    ap.add_argument(
        "--reps", type=int, default=15, help="passes per build at each row count (median)"
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="kernel threads (default: the engine's)"
    )
    ap.add_argument(
        "--head",
        action="store_true",
        help="time the lm_head (fp32 logits from the fp32 final-norm rows) instead of the linears",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    try:
        args.row_list = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rows: not a list of integers: {args.rows!r}")
    if not args.row_list or min(args.row_list) < 1:
        ap.error("--rows needs one or more positive integers")
    return args


def base_library(rev: str, tmp: Path, march: str = "native"):
    """The kernels of `rev`, compiled for `march` from `git archive` into tmp and loaded from a
    private copy (so HEAD against an unchanged tree still loads two libraries; functions it lacks
    are left out). Raises ValueError with the reason when the revision cannot be read or its
    kernels do not build."""
    from engine.kernels import build_library

    proc = subprocess.run(
        ["git", "-C", str(_ROOT), "archive", "--format=tar", rev, "engine/kernels"],
        capture_output=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise ValueError(
            f"git archive {rev!r} failed: {proc.stderr.decode(errors='replace').strip()[:300]}"
        )
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(tmp, filter="data")
    return build_library(tmp / "engine" / "kernels", private_copy=True, march=march)


def _engine(model: str, scheme: str, threads: int | None, dtype: str = "bfloat16"):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    return EngineCore(
        EngineConfig(
            model=model,
            dtype=dtype,
            device="cpu",
            threads=threads,
            max_num_seqs=8,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,
            num_kv_blocks=80,
            max_model_len=1024,
            quantization=engine_runs.quantization(scheme),
        )
    )


def _use(lins: list[Any], lib) -> None:
    """Points every layer at `lib`: a linear's own `.lib`, a quantized lm_head's QLinear's."""
    for lin in lins:
        if getattr(lin, "q", None) is not None:
            lin.q.lib = lib
        else:
            lin.lib = lib


def compare(
    lins: list[Any], libs: tuple[Any, Any], rows: int, reps: int, seed: int, dtype: Any = None
) -> dict[str, Any]:
    """Median ms of one pass over `lins` at `rows` rows with each library, alternating, and whether
    their outputs are bitwise identical. The lm_head (a LogitsHead) gets fp32 rows, as the final
    norm gives it; the linears rows of `dtype`."""
    import torch

    from engine.logits_head import LogitsHead

    g = torch.Generator().manual_seed(seed)

    def row(lin) -> Any:
        if isinstance(lin, LogitsHead):
            if lin.q is not None:
                width = lin.q.in_features
            else:
                assert lin.weight is not None  # a head keeps its weight or its quantized copy
                width = lin.weight.shape[1]
            return torch.randn(rows, width, generator=g)
        return torch.randn(rows, _in_features(lin), generator=g).to(dtype or torch.bfloat16)

    xs = [row(lin) for lin in lins]

    def one_pass(lib) -> list[Any]:
        _use(lins, lib)
        return [lin(x) for lin, x in zip(lins, xs, strict=True)]

    outs = [one_pass(lib) for lib in libs]  # also the warm-up: first-call allocations
    identical = all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for lib, t in zip(libs, times, strict=True):
            _use(lins, lib)
            flush.add_(1)  # no weight left in the caches: a step reads the whole model
            t0 = time.perf_counter()
            for lin, x in zip(lins, xs, strict=True):
                lin(x)
            t.append(time.perf_counter() - t0)
    a, b = (1e3 * statistics.median(t) for t in times)
    return {"rows": rows, "base_ms": a, "this_ms": b, "ratio": b / a, "identical": identical}


def run(args: argparse.Namespace, progress) -> dict[str, Any]:
    from engine.kernels import build_library, kernels_lib

    this = kernels_lib()
    if this is None:
        raise ValueError(
            "this checkout's kernels are not available (no C compiler, or DUET_DISABLE_KERNELS)"
        )
    import torch

    if args.march != "native":
        progress(f"building this checkout's kernels for -march={args.march}")
        this = build_library(private_copy=True, march=args.march)
    result: dict[str, Any] = {
        "machine": machine_info(args.threads or torch.get_num_threads()),
        "base": args.base,
        "base_march": args.base_march,
        "march": args.march,
        "layers": "lm_head" if args.head else "linears",
        "schemes": {},
    }
    with tempfile.TemporaryDirectory(prefix="duet-kernel-ab-") as tmp:
        if args.base_dir is not None:
            progress(f"building the kernels in {args.base_dir}")
            if not args.base_dir.is_dir():
                raise ValueError(f"--base-dir {args.base_dir}: not a directory")
            base = build_library(args.base_dir, private_copy=True, march=args.base_march)
            result["base"] = str(args.base_dir)
        else:
            progress(f"building the kernels of {args.base} for -march={args.base_march}")
            base = base_library(args.base, Path(tmp), args.base_march)
        for scheme in [s.strip() for s in args.schemes.split(",") if s.strip()]:
            progress(f"{scheme}: loading")
            eng = _engine(args.model, scheme, args.threads, args.dtype)
            lins = [eng.runner.model.lm_head] if args.head else _linears(eng)
            rows = []
            for r in args.row_list:
                row = compare(lins, (base, this), r, args.reps, args.seed, eng.dtype)
                progress(
                    f"{scheme}: {r} rows: base {row['base_ms']:.2f} ms, this {row['this_ms']:.2f} "
                    f"ms ({row['ratio']:.3f}x), outputs "
                    f"{'identical' if row['identical'] else 'DIFFER'}"
                )
                rows.append(row)
            _use(lins, this)
            result["schemes"][scheme] = rows
            del eng, lins
    return result


def table(result: dict[str, Any]) -> str:
    lines = [f"{'scheme':>10} {'rows':>5} {'base ms':>9} {'this ms':>9} {'this/base':>9}  outputs"]
    for scheme, rows in result["schemes"].items():
        for r in rows:
            lines.append(
                f"{scheme:>10} {r['rows']:>5} {r['base_ms']:>9.2f} {r['this_ms']:>9.2f} "
                f"{r['ratio']:>8.3f}x  {'identical' if r['identical'] else 'differ'}"
            )
    m = result["machine"]
    lines.append(
        f"{result['layers']}; base {result['base']} (-march={result['base_march']}), this "
        f"-march={result['march']}; {m.get('cpu')}, load average at the end "
        f"{m.get('load_avg_1m_at_end')}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def progress(msg: str) -> None:
        print(f"[bench.kernel_ab {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    try:
        result = run(args, progress)
    except ValueError as e:
        print(f"bench.kernel_ab: {e}", file=sys.stderr)
        return 2
    result["machine"]["load_avg_1m_at_end"] = (
        round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    )
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
