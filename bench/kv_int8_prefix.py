"""`python -m bench.kv_int8_prefix`: what a turn after a cached history costs on an 8-bit KV pool.

A multi-turn conversation's next request is a short chunk of new tokens (`--chunk`) after a long
prefix the node already holds (`--prefix`, a prefix-cache hit). On an int8 pool the chunk attends
to the whole history read back from the pool: through the paged attention kernel's int8 path,
which reads the rows in place (what the engine runs), or through SDPA over the history gathered
and dequantized once per layer (what it ran before; `engine.attention.INT8_PREFIX_ON_KERNEL`).
The model's own pool (`auto`) is the third column.

In one process, an engine per path on the model (SmolLM2 by default): the prefix is prefilled once
per engine, then each round times one chunk (fresh random tokens after the same prefix, one output
token) per path, in turn, by this process's CPU time (use `--threads 1` on a shared machine: a
CPU-second is then the steadier figure of the work). Prints each path's median and the ratios of
each round's pair, and whether the paths chose the same greedy tokens.
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
from engine import attention as attention_mod
from engine.core import EngineCore
from runtime.models import DEFAULT_MODEL


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_int8_prefix", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="activations' dtype (default: %(default)s)")
    p.add_argument("--prefix", type=int, default=2048, help="cached tokens (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=32, help="new tokens (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="chunks a path (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def build(args: argparse.Namespace, kv: str) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            kv_cache_dtype=kv,  # type: ignore[arg-type]
            max_model_len=args.prefix + args.chunk + 16,
            max_num_batched_tokens=max(512, args.chunk),
            enable_prefix_caching=True,
            threads=args.threads,
        )
    )


def prefill(core: EngineCore, ids: list[int], tag: str) -> tuple[float, int | None]:
    """CPU seconds to prefill `ids` and sample one token; the token."""
    core.add_request(tag, ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    c0, token = time.process_time(), None
    while core.has_unfinished():
        outs, _ = core.step()
        for o in outs:
            if o.new_token_ids:
                token = o.new_token_ids[0]
    return time.process_time() - c0, token


def measure(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    # path: (its engine's KV dtype, int8 prefix chunks on the kernel); an engine each, so every
    # path sees the same chunk uncached (a chunk's full blocks are cached once prefilled)
    paths = {"int8 kernel": ("int8", True), "int8 sdpa": ("int8", False), "auto": ("auto", True)}
    engines = {name: build(args, kv) for name, (kv, _) in paths.items()}
    rng = random.Random(0)
    vocab = engines["auto"].model_config.vocab_size
    prefix = [rng.randrange(10, vocab) for _ in range(args.prefix)]
    for name, core in engines.items():
        progress(f"prefilling the {args.prefix}-token prefix ({name})")
        prefill(core, prefix, f"prefix-{name}")
    runs: dict[str, list[float]] = {p: [] for p in paths}
    tokens: dict[str, list[int | None]] = {p: [] for p in paths}
    try:
        for r in range(args.rounds):
            chunk = [rng.randrange(10, vocab) for _ in range(args.chunk)]
            for name, (_, on_kernel) in paths.items():
                attention_mod.INT8_PREFIX_ON_KERNEL = on_kernel
                s, tok = prefill(engines[name], prefix + chunk, f"r{r}-{name}")
                runs[name].append(s)
                tokens[name].append(tok)
            progress(
                f"round {r + 1}: "
                + ", ".join(f"{p} {v[-1] * 1000:.1f} ms" for p, v in runs.items())
            )
    finally:
        attention_mod.INT8_PREFIX_ON_KERNEL = True
    k = runs["int8 kernel"]
    return {
        "config": vars(args),
        "cpu_ms_median": {p: statistics.median(v) * 1000 for p, v in runs.items()},
        "sdpa_over_kernel": statistics.median(
            b / a for a, b in zip(k, runs["int8 sdpa"], strict=True)
        ),
        "auto_over_kernel": statistics.median(b / a for a, b in zip(k, runs["auto"], strict=True)),
        "same_tokens_kernel_sdpa": tokens["int8 kernel"] == tokens["int8 sdpa"],
        "load": os.getloadavg(),
    }


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"{c['chunk']} new tokens after a cached {c['prefix']}, {c['dtype']}, "
        f"{c['threads']} thread(s), CPU ms per prefill (median of {c['rounds']}):"
    ]
    lines += [f"  {p:<12} {ms:8.1f}" for p, ms in result["cpu_ms_median"].items()]
    lines.append(
        f"int8 sdpa / int8 kernel {result['sdpa_over_kernel']:.2f}x, "
        f"auto pool / int8 kernel {result['auto_over_kernel']:.2f}x, "
        f"same greedy tokens (kernel, sdpa): {result['same_tokens_kernel_sdpa']} "
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
