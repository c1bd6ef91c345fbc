"""`python -m bench.quant_engine`: single-stream and 32-way decode of the native engine with
bf16, int8 and int4 weights side by side, measured in one run on this machine.

Each scheme gets its own in-process EngineCore with the same activation dtype, KV pool and
prompts; decode figures come from bench.engine_runs.steady_decode (median step time, prefill
excluded). Also reported per scheme: bytes of linear weights read per decode step, model load
time, where a single-stream step spends its time (each linear kind, the rest of the forward
pass, the rest of the step; wall time, best of three short passes), and the model's linears
timed at `--linear-rows` activation rows with the weight-only tiers' panel dequantization
(bench/linear_rows.py: where a quantized tier's batch and prefill time goes).
Progress goes to stderr; a table, or one JSON object with --json, to stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import engine_runs
from bench.flops import ModelShape, machine_info
from bench.linear_rows import time_linears

SCHEMES = ("none", "int8", "int4")
TARGETS = {"int4": 110.0, "int8": 85.0}  # single-stream tokens/s, on a quiet machine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.quant_engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="model name or directory (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="activation/KV dtype for every scheme; 'none' means weights in this dtype too",
    )
    p.add_argument(
        "--schemes", default=",".join(SCHEMES), help="comma-separated: none,int8,int4,int4-g64"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch/OpenMP threads (default: all cores)"
    )
    p.add_argument(
        "--context", type=int, default=256, help="prompt tokens before decoding (default 256)"
    )
    p.add_argument(
        "--steps", type=int, default=32, help="timed decode steps per figure (default 32)"
    )
    p.add_argument("--batches", default="1,32", help="decode batch sizes (default 1,32)")
    p.add_argument(
        "--no-profile", action="store_true", help="skip the time breakdown of a single-stream step"
    )
    p.add_argument(
        "--linear-rows",
        default="1,32,512",
        help="time every linear layer at these activation rows (a decode step, a decode batch, a "
        "prefill chunk; '' to skip; default %(default)s)",
    )
    p.add_argument(
        "--linear-reps",
        type=int,
        default=15,
        help="passes per --linear-rows figure (median; default 15)",
    )
    p.add_argument(
        "--profile-clock",
        choices=["wall", "cpu"],
        default="wall",
        help="clock of the breakdown; cpu (this process's CPU time) is less disturbed by other "
        "work on a busy machine, use it with --threads 1 (default: wall)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _engine(args: argparse.Namespace, scheme: str, batch: int):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    max_len = 1024
    blocks = batch * ((args.context + 2 * args.steps + 80) // 16 + 2) + 8
    return EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            threads=args.threads,
            max_num_seqs=batch,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,
            num_kv_blocks=max(blocks, max_len // 16 + 1),
            max_model_len=max_len,
            quantization=engine_runs.quantization(scheme),
        )
    )


def weight_bytes(eng) -> int:
    """Bytes of linear weights one decode step reads (all layers' matrices and the lm_head)."""
    from engine.qlinear import QLinear

    model = eng.runner.model
    lins = [
        lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    head = model.lm_head.q or model.lm_head
    total = 0
    for lin in [*lins, head]:
        if isinstance(lin, QLinear):
            total += lin.weight.nbytes
        else:
            t = next(
                t
                for t in (getattr(lin, "panels", None), getattr(lin, "packed", None), lin.weight)
                if t is not None
            )
            total += t.numel() * t.element_size()
    return total


class _Timed:
    """Wraps a layer; adds its wall time to `totals[bucket]`."""

    def __init__(
        self, inner, bucket: str, totals: dict[str, float], clock: Callable[[], float]
    ) -> None:
        self.inner, self.bucket, self.totals, self.clock = inner, bucket, totals, clock

    def __call__(self, *args):
        t0 = self.clock()
        out = self.inner(*args)
        self.totals[self.bucket] += self.clock() - t0
        return out


def profile_step(
    eng,
    shape: ModelShape,
    rng: random.Random,
    clock: Callable[[], float] = time.perf_counter,
    steps: int = 16,
) -> dict[str, float]:
    """Where a single-stream decode step spends its time (ms per step, best of 3 passes): the
    linear layers by kind, the rest of the forward pass (attention, norms, rope, embedding), and
    the rest of the step (scheduling, sampling, detokenizing). `clock` may be CPU time, which a
    busy machine disturbs less (with one thread)."""
    from bench.workload import random_prompt

    model = eng.runner.model
    eng.add_request("prof", random_prompt(rng, 64, shape.vocab), engine_runs._greedy(4 * steps + 8))
    while not eng.request("prof").output_token_ids:
        eng.step()
    eng.step()
    kinds = ("qkv", "o", "gate_up", "down")
    saved = (
        [{k: getattr(layer, k) for k in kinds} for layer in model.layers],
        model.lm_head,
        model.forward,
    )
    best: dict[str, float] = {}
    try:
        for _ in range(3):
            totals = dict.fromkeys([*kinds, "lm_head", "forward", "step"], 0.0)
            for layer, orig in zip(model.layers, saved[0], strict=True):
                for k in kinds:
                    setattr(layer, k, _Timed(orig[k], k, totals, clock))
            model.lm_head = _Timed(saved[1], "lm_head", totals, clock)
            model.forward = _Timed(saved[2], "forward", totals, clock)
            t0 = clock()
            for _ in range(steps):
                eng.step()
            totals["step"] = clock() - t0
            if not best or totals["step"] < best["step"]:
                best = totals
    finally:
        for layer, orig in zip(model.layers, saved[0], strict=True):
            for k in kinds:
                setattr(layer, k, orig[k])
        model.lm_head = saved[1]
        del model.forward  # back to the class's method
    eng.abort("prof")
    ms = {k: 1e3 * v / steps for k, v in best.items()}
    linears = sum(ms[k] for k in (*kinds, "lm_head"))
    return {
        "step_ms": ms["step"],
        "forward_ms": ms["forward"],
        "linears_ms": linears,
        **{f"{k}_ms": ms[k] for k in (*kinds, "lm_head")},
        "other_forward_ms": ms["forward"] - linears,
        "outside_forward_ms": ms["step"] - ms["forward"],
    }


def run(args: argparse.Namespace, progress: engine_runs.Progress) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    result: dict[str, Any] = {
        "machine": machine_info(torch.get_num_threads()),
        "config": {
            "model": args.model,
            "dtype": args.dtype,
            "context": args.context,
            "steps": args.steps,
            "batches": batches,
        },
        "schemes": {},
    }
    for scheme in [s.strip() for s in args.schemes.split(",") if s.strip()]:
        progress(f"{scheme}: loading")
        t0 = time.perf_counter()
        eng = _engine(args, scheme, max(batches))
        row: dict[str, Any] = {
            "load_s": time.perf_counter() - t0,
            "weight_bytes": weight_bytes(eng),
        }
        shape = ModelShape.of(eng.model_config)
        rng = random.Random(args.seed)
        for b in batches:
            progress(f"{scheme}: decode with {b} sequence(s)")
            row[f"decode_{b}"] = engine_runs.steady_decode(
                eng, shape, b, args.context, args.steps, rng
            )
        if not args.no_profile:
            progress(f"{scheme}: profiling a single-stream step")
            clock = time.process_time if args.profile_clock == "cpu" else time.perf_counter
            row["profile"] = {"clock": args.profile_clock, **profile_step(eng, shape, rng, clock)}
        linear_rows = [int(r) for r in args.linear_rows.split(",") if r.strip()]
        if linear_rows:
            progress(f"{scheme}: the linears at {linear_rows} rows")
            row["linears"] = time_linears(eng, linear_rows, args.linear_reps, args.seed)
        result["schemes"][scheme] = row
        del eng
    base = result["schemes"].get("none")
    for scheme, row in result["schemes"].items():
        if base is not None:
            row["speedup_vs_none"] = {
                f"decode_{b}": row[f"decode_{b}"]["tokens_per_s"]
                / base[f"decode_{b}"]["tokens_per_s"]
                for b in batches
            }
        if scheme in TARGETS and 1 in batches:
            row["target_single_stream"] = {
                "tokens_per_s": TARGETS[scheme],
                "met": row["decode_1"]["tokens_per_s"] >= TARGETS[scheme],
            }
    return result


def table(result: dict[str, Any]) -> str:
    batches = result["config"]["batches"]
    head = ["scheme", "weights MiB", *[f"decode x{b} tok/s" for b in batches], "load s"]
    rows = [
        [
            s,
            f"{r['weight_bytes'] / 2**20:.1f}",
            *[f"{r[f'decode_{b}']['tokens_per_s']:.1f}" for b in batches],
            f"{r['load_s']:.1f}",
        ]
        for s, r in result["schemes"].items()
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    m = result["machine"]
    lines.append(
        f"{m['cpu']}, {m['threads']} threads, load average {m.get('load_avg_1m_at_start')} at the "
        "start"
    )
    for s, r in result["schemes"].items():
        if "linears" in r:
            lines.append(
                f"{s:>5} all linears, ms: "
                + ", ".join(
                    f"{k.removesuffix('_ms').replace('_', ' ')} {v:.2f}"
                    for k, v in r["linears"].items()
                    if v is not None
                )
            )
    for s, r in result["schemes"].items():
        if "profile" in r:
            lines.append(
                f"{s:>5} single-stream step, ms: "
                + ", ".join(
                    f"{k.removesuffix('_ms')} {v:.2f}"
                    for k, v in r["profile"].items()
                    if k != "clock"
                )
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def progress(msg: str) -> None:
        print(
            f"[bench.quant_engine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True
        )

    result = run(args, progress)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
