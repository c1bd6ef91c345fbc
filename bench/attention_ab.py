"""`python -m bench.attention_ab`: this checkout's attention, rope and norm kernels against another
revision's, in one process, on SmolLM2's attention shape.

The same method as bench/kernel_ab.py (which does it for the linears): both builds are loaded
side by side (the other revision's `engine/kernels/` from `git archive`, or a directory of
variant sources), every pass alternates them over the same inputs, and the figure is the median
pass time of each build and their ratio, beside whether their outputs are bitwise identical (and
the largest difference where they are not).

Cases (one layer of a paged pool whose blocks are shuffled, as a long-running pool's are):
- `decode1`: one sequence's decode token at context --context (single-stream decode, W2);
- `decode32`: 32 sequences' decode tokens at contexts around --context (a batched step, W3);
- `prefill`: one --prefill-len-token prompt's prefill attention (W1);
- `rope`: rope_store of the prefill's tokens; `norms`: the residual norm and SiLU·up of
  --norm-rows rows (in the dtype's own kernels: res_norm_f32/silu_mul_bf16, or the fp32 ones).

Limits: both builds are called through this checkout's ctypes signatures; a function the base
lacks is reported as missing for that case. Timing only; no figure is a bound in a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.flops import machine_info
from bench.kernel_ab import base_library

CASES = ("decode1", "decode32", "prefill", "rope", "norms")
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 9, 3, 64, 576, 1536


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.attention_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--base", default="HEAD", help="git revision of the baseline kernels")
    ap.add_argument("--base-dir", type=Path, default=None, help="a directory of kernel sources")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES)
    )
    ap.add_argument("--context", type=int, default=320, help="decode context (tokens)")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--norm-rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=21, help="passes per build (median)")
    ap.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: torch's)")
    ap.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: this process's CPU time (all threads; on a loaded machine it leaves out the "
        "time the process waited for a core, which wall time does not); wall: elapsed time",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    args.case_list = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not args.case_list or set(args.case_list) - set(CASES):
        ap.error(f"--cases: a subset of {','.join(CASES)}")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    return args


class _Pool:
    """A one-layer paged pool with shuffled blocks and a step over it (decodes or one prefill)."""

    def __init__(self, dtype, decodes: list[int], prefill: int, seed: int = 0) -> None:
        import torch

        from engine.attention import build_metadata
        from engine.kernel_step import KernelStep
        from engine.rope import Rope

        g = torch.Generator().manual_seed(seed)
        bs = 16
        per_seq = -(-max([*decodes, prefill, 1]) // bs) + 1
        nseq = max(len(decodes), 1)
        nb = nseq * per_seq + 1
        self.cache = torch.randn(nb, 1, 2, bs, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        blocks = list(range(nb))
        random.Random(seed).shuffle(blocks)
        tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(nseq)]
        md = build_metadata(
            bs,
            [(tables[i], c - 1) for i, c in enumerate(decodes)],
            [(tables[0], 0, prefill)] if prefill else [],
            None,
            torch.device("cpu"),
        )
        self.md = md
        self.rope = Rope(
            HEAD_DIM, 10000.0, None, max(4096, prefill + 1), dtype, torch.device("cpu")
        )
        width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.qkv = torch.randn(md.num_tokens, width, generator=g).to(dtype)
        self.out = torch.empty(md.num_tokens, HEADS * HEAD_DIM, dtype=dtype)
        self.step = KernelStep(
            self.cache,
            md.block_tables,
            md.token_row,
            md.ctx_lens,
            md.positions,
            md.slot_block,
            md.slot_offset,
            self.rope.cos,
            self.rope.sin,
            HEADS,
            md.max_ctx,
            None,
        )


def _case(name: str, dtype, args: argparse.Namespace) -> tuple[Callable[[Any], Any], int]:
    """`call(lib)` running the case once and returning its output, and the bytes it streams
    (0 where that is not the point)."""
    import torch

    rng = random.Random(1)
    if name in ("decode1", "decode32"):
        n = 1 if name == "decode1" else 32
        ctxs = [args.context] if n == 1 else [args.context + rng.randint(-64, 64) for _ in range(n)]
        p = _Pool(dtype, ctxs, 0)
        nd = p.md.num_decode

        def call(lib: Any) -> Any:
            lib.paged_attention(
                p.step.ptr,
                0,
                0,
                nd,
                p.qkv.data_ptr(),
                p.qkv.stride(0),
                p.out.data_ptr(),
                p.out.stride(0),
            )
            return p.out.clone()

        return call, p.cache.nbytes
    if name == "prefill":
        p = _Pool(dtype, [], args.prefill_len)
        t = p.md.num_tokens
        # the K/V of the prompt are in the pool already (rope_store ran)
        p.step.struct.num_tokens = t

        def call(lib: Any) -> Any:
            lib.prefill_attention(
                p.step.ptr,
                0,
                0,
                t,
                p.qkv.data_ptr(),
                p.qkv.stride(0),
                p.out.data_ptr(),
                p.out.stride(0),
            )
            return p.out.clone()

        return call, 0
    if name == "rope":
        p = _Pool(dtype, [], args.prefill_len)
        src = p.qkv.clone()

        def call(lib: Any) -> Any:
            p.qkv.copy_(src)
            lib.rope_store(p.step.ptr, 0, p.qkv.data_ptr(), p.qkv.stride(0))
            return p.qkv.clone()

        return call, 0
    g = torch.Generator().manual_seed(2)
    rows = args.norm_rows
    h0 = torch.randn(rows, HIDDEN, generator=g)
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    d = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    gu = (3 * torch.randn(rows, 2 * INTER, generator=g)).to(dtype)
    x = torch.empty(rows, HIDDEN, dtype=dtype)
    act = torch.empty(rows, INTER, dtype=dtype)
    bf16 = dtype == torch.bfloat16

    def norms(lib: Any) -> Any:
        h = h0.clone()
        if bf16:
            lib.res_norm_f32(
                h.data_ptr(), d.data_ptr(), w.data_ptr(), x.data_ptr(), rows, HIDDEN, 1e-5, 0
            )
            lib.silu_mul_bf16(gu.data_ptr(), act.data_ptr(), rows, INTER)
        else:
            lib.add_rms_norm_f32(
                h.data_ptr(), d.data_ptr(), w.data_ptr(), x.data_ptr(), rows, HIDDEN, 1e-5
            )
            lib.silu_mul_f32(gu.data_ptr(), act.data_ptr(), rows, INTER)
        return torch.cat([h.flatten(), x.float().flatten(), act.float().flatten()])

    return norms, 0


def compare(
    call: Callable[[Any], Any], libs: tuple[Any, Any], reps: int, clock: str = "cpu"
) -> dict[str, Any]:
    """Median ms of `call` with each library, alternating, and how their outputs differ."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    outs = [call(lib) for lib in libs]  # also the warm-up
    a, b = outs[0].float(), outs[1].float()
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for lib, t in zip(libs, times, strict=True):
            t0 = now()
            call(lib)
            t.append(now() - t0)
    ma, mb = (1e3 * statistics.median(t) for t in times)
    return {
        "base_ms": ma,
        "this_ms": mb,
        "ratio": mb / ma,
        "identical": diff == 0.0,
        "max_diff": diff,
    }


def run(args: argparse.Namespace, progress) -> dict[str, Any]:
    import torch

    from engine.kernels import build_library, kernels_lib

    if args.threads:
        torch.set_num_threads(args.threads)
    this = kernels_lib()
    if this is None:
        raise ValueError("this checkout's kernels are not available")
    result: dict[str, Any] = {
        "machine": machine_info(torch.get_num_threads()),
        "base": args.base,
        "clock": args.clock,
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="duet-attention-ab-") as tmp:
        if args.base_dir is not None:
            base = build_library(args.base_dir, private_copy=True)
            result["base"] = str(args.base_dir)
        else:
            progress(f"building the kernels of {args.base}")
            base = base_library(args.base, Path(tmp))
        for dt in [s.strip() for s in args.dtypes.split(",") if s.strip()]:
            dtype = getattr(torch, dt)
            for name in args.case_list:
                call, _ = _case(name, dtype, args)
                try:
                    row = {
                        "dtype": dt,
                        "case": name,
                        **compare(call, (base, this), args.reps, args.clock),
                    }
                except AttributeError as e:
                    progress(f"{dt} {name}: skipped ({e})")
                    continue
                progress(
                    f"{dt} {name}: base {row['base_ms']:.3f} ms, this {row['this_ms']:.3f} ms "
                    f"({row['ratio']:.3f}x), outputs "
                    + ("identical" if row["identical"] else f"differ (max {row['max_diff']:.2e})")
                )
                result["rows"].append(row)
    return result


def table(result: dict[str, Any]) -> str:
    lines = [f"{'dtype':>9} {'case':>9} {'base ms':>9} {'this ms':>9} {'this/base':>9}  outputs"]
    for r in result["rows"]:
        out = "identical" if r["identical"] else f"differ (max {r['max_diff']:.2e})"
        lines.append(
            f"{r['dtype']:>9} {r['case']:>9} {r['base_ms']:>9.3f} {r['this_ms']:>9.3f} "
            f"{r['ratio']:>8.3f}x  {out}"
        )
    m = result["machine"]
    lines.append(
        f"base {result['base']}; {result['clock']} time; {m.get('cpu')}, {m.get('threads')} "
        f"threads, load average at the end {m.get('load_avg_1m_at_end')}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def progress(msg: str) -> None:
        print(
            f"[bench.attention_ab {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True
        )

    try:
        result = run(args, progress)
    except ValueError as e:
        print(f"bench.attention_ab: {e}", file=sys.stderr)
        return 2
    result["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
