"""`python -m bench.kv_int8`: what the 8-bit KV pool (`--kv-cache-dtype int8`) buys at equal
`--kv-memory`: blocks and sequences that fit, and batch decode throughput.

In one process, on the model's own engine (SmolLM2 by default), for each KV dtype (`auto`, the
model's dtype, and `int8`) an engine with the same `--kv-memory`:
- its pool's blocks, and the sequences of `--prompt-len` + `--max-tokens` tokens that fit at once;
- a batch run: `--requests` greedy requests of that shape (distinct random prompts, no prefix
  reuse), all submitted at once with `--max-num-seqs` room to run them together, timed to the
  last token: output tokens per second, the decode steps' tokens per second (steps that computed
  no prompt token), and the most sequences that ran at once (a pool that holds fewer preempts or
  queues the rest).
The two engines alternate `--rounds` times (the machine's load drifts; a ratio of one round's
pair is the figure), and both are built before the first round, so each round sees the same
process. On a shared, oversubscribed machine wall time follows the neighbours' load more than
the engine: tokens per CPU-second of this process (`output_tok_cpu_s`, meaningful with
`--threads 1`) is then the steadier figure of the work a token costs. Progress on stderr; a
table, or one JSON object with --json, on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from engine import EngineConfig, SamplingParams
from engine.core import EngineCore
from runtime.models import DEFAULT_MODEL


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_int8", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="activations' dtype (default: %(default)s)")
    p.add_argument("--kv-memory", default="24MiB", help="each pool's size (default: %(default)s)")
    p.add_argument(
        "--prompt-len", type=int, default=96, help="tokens a prompt (default: %(default)s)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=32, help="tokens generated (default: %(default)s)"
    )
    p.add_argument("--requests", type=int, default=48, help="requests a run (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="alternations (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def build(args: argparse.Namespace, kv: str) -> EngineCore:
    seq = args.prompt_len + args.max_tokens
    return EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            kv_memory=args.kv_memory,
            kv_cache_dtype=kv,  # type: ignore[arg-type]
            max_model_len=seq + 16,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=False,
            threads=args.threads,
        )
    )


def batch(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    out_tokens = decode_tokens = peak = 0
    decode_s = 0.0
    computed0 = core.counters.prompt_tokens_computed
    t0, c0 = time.perf_counter(), time.process_time()
    while core.has_unfinished():
        before = core.counters.prompt_tokens_computed
        s0 = time.perf_counter()
        outs, _ = core.step()
        dt = time.perf_counter() - s0
        n = sum(len(o.new_token_ids) for o in outs)
        out_tokens += n
        peak = max(peak, len(core.scheduler.running))
        if core.counters.prompt_tokens_computed == before:
            decode_s += dt
            decode_tokens += n
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "seconds": wall,
        "cpu_seconds": cpu,
        "output_tok_s": out_tokens / wall,
        "output_tok_cpu_s": out_tokens / cpu,
        "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
        "peak_running": peak,
        "prompt_tokens_computed": core.counters.prompt_tokens_computed - computed0,
    }


def measure(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {kv: build(args, kv) for kv in ("auto", "int8")}
    seq_blocks = -(-(args.prompt_len + args.max_tokens) // 16)
    result: dict[str, Any] = {"config": vars(args), "engines": {}}
    for kv, core in engines.items():
        layout = core.runner.kv_layout
        result["engines"][kv] = {
            "kv_dtype": layout.dtype,
            "block_bytes": layout.block_bytes,
            "blocks": layout.num_blocks,
            "sequences_fit": layout.num_blocks // seq_blocks,
            "runs": [],
        }
    rng = random.Random(0)
    vocab = next(iter(engines.values())).model_config.vocab_size
    for r in range(args.rounds):
        for kv, core in engines.items():
            prompts = [
                [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
                for _ in range(args.requests)
            ]
            progress(f"round {r + 1}: {kv}")
            run = batch(core, prompts, args.max_tokens)
            progress(f"  {run}")
            result["engines"][kv]["runs"].append(run)
    a, b = result["engines"]["auto"], result["engines"]["int8"]
    result["ratios"] = {
        "blocks": b["blocks"] / a["blocks"],
        "sequences_fit": b["sequences_fit"] / max(1, a["sequences_fit"]),
        "output_tok_s": statistics.median(
            y["output_tok_s"] / x["output_tok_s"] for x, y in zip(a["runs"], b["runs"], strict=True)
        ),
        "output_tok_cpu_s": statistics.median(
            y["output_tok_cpu_s"] / x["output_tok_cpu_s"]
            for x, y in zip(a["runs"], b["runs"], strict=True)
        ),
        "decode_tok_s": statistics.median(
            y["decode_tok_s"] / x["decode_tok_s"] for x, y in zip(a["runs"], b["runs"], strict=True)
        ),
    }
    result["load"] = os.getloadavg()
    return result


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'kv':>5}  {'blocks':>7}  {'seqs fit':>8}  {'peak run':>8}  "
        f"{'out tok/s':>9}  {'dec tok/s':>9}"
    ]
    for e in result["engines"].values():
        runs = e["runs"]
        lines.append(
            f"{e['kv_dtype']:>5.5}  {e['blocks']:>7}  {e['sequences_fit']:>8}  "
            f"{max(r['peak_running'] for r in runs):>8}  "
            f"{statistics.median(r['output_tok_s'] for r in runs):>9.1f}  "
            f"{statistics.median(r['decode_tok_s'] for r in runs):>9.1f}"
        )
    ra = result["ratios"]
    lines.append(
        f"int8 / auto: blocks {ra['blocks']:.2f}x, sequences {ra['sequences_fit']:.2f}x, "
        f"output tok/s {ra['output_tok_s']:.2f}x (per CPU-second {ra['output_tok_cpu_s']:.2f}x), "
        f"decode tok/s {ra['decode_tok_s']:.2f}x "
        f"(load {result['load'][0]:.1f})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args, lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
