"""`python -m bench.batch_ttft`: what batch traffic costs interactive users.

Measures interactive time to first token on one colocated node in three phases:

  idle          interactive requests alone, one at a time
  batch         the same, while --batch-streams loops send long completions at priority=batch
                (what the batch runner sends)
  no-priority   the same load sent at priority=interactive, i.e. without the batch tier

and the background load's throughput (completion tokens/s) in the last two phases. Fresh
random token prompts (no prefix-cache hits). Starts its own node unless --url names one.
Medians and p95 over --interactive requests per phase; one JSON object with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.pd_client import completion
from bench.procs import duet_node, running
from protocol.models import DEFAULT_MODEL, resolve_model


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.batch_ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL, help="model to serve (when starting a node)")
    p.add_argument("--url", default=None, help="an existing node's URL (default: start one)")
    p.add_argument("--interactive", type=int, default=20, help="interactive requests per phase")
    p.add_argument("--prompt-len", type=int, default=128, help="interactive prompt tokens")
    p.add_argument("--max-tokens", type=int, default=8, help="interactive completion tokens")
    p.add_argument("--batch-streams", type=int, default=4, help="concurrent background requests")
    p.add_argument("--batch-prompt-len", type=int, default=256)
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-blocks", type=int, default=None, help="node KV pool size (blocks)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 300) for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def _background(s: aiohttp.ClientSession, url: str, a: argparse.Namespace, priority: str,
                      stop: asyncio.Event, seed: int, tokens: list[int]) -> None:  # fmt: skip
    rng = random.Random(seed)
    params = {"max_tokens": a.batch_max_tokens, "temperature": 0, "ignore_eos": True, "priority": priority}
    while not stop.is_set():
        r = await completion(s, url, _prompt(rng, a.batch_prompt_len), params)
        if r.error:
            raise RuntimeError(f"background request failed: {r.error}")
        tokens.append(len(r.token_ids))


async def _phase(s: aiohttp.ClientSession, url: str, a: argparse.Namespace, load: str | None,
                 seed: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    stop = asyncio.Event()
    tokens: list[int] = []
    bg = [asyncio.create_task(_background(s, url, a, load, stop, seed * 100 + i, tokens))
          for i in range(a.batch_streams if load else 0)]  # fmt: skip
    t0 = time.perf_counter()
    ttfts = []
    params = {"max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True, "priority": "interactive"}
    try:
        for i in range(a.interactive):
            r = await completion(s, url, _prompt(rng, a.prompt_len), params)
            if r.error or r.ttft is None:
                raise RuntimeError(f"interactive request failed: {r.error}")
            ttfts.append(r.ttft)
            print(f"\r  {load or 'idle'}: {i + 1}/{a.interactive}", end="", file=sys.stderr, flush=True)
    finally:
        elapsed = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*bg)  # in-flight background requests finish, then the phase ends
    print(file=sys.stderr)
    return {"ttft_p50_ms": statistics.median(ttfts) * 1e3, "ttft_p95_ms": _pct(ttfts, 0.95) * 1e3,
            "ttft_mean_ms": statistics.fmean(ttfts) * 1e3, "requests": len(ttfts),
            "background_tokens_per_s": sum(tokens) / elapsed if load else 0.0}  # fmt: skip


async def _run(url: str, a: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        # One warm-up request so the first phase does not pay for kernel caches.
        await completion(s, url, list(range(10, 10 + a.prompt_len)), {"max_tokens": 2, "temperature": 0})
        phases = {"idle": await _phase(s, url, a, None, 1),
                  "batch": await _phase(s, url, a, "batch", 2),
                  "no_priority": await _phase(s, url, a, "interactive", 3)}  # fmt: skip
    idle = phases["idle"]["ttft_p50_ms"]
    return {
        "url": url, "interactive": a.interactive, "batch_streams": a.batch_streams,
        "prompt_len": a.prompt_len, "batch_prompt_len": a.batch_prompt_len,
        "batch_max_tokens": a.batch_max_tokens, "phases": phases,
        "ttft_p50_ratio_batch_vs_idle": phases["batch"]["ttft_p50_ms"] / idle,
        "ttft_p50_ratio_no_priority_vs_idle": phases["no_priority"]["ttft_p50_ms"] / idle,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.url:
        report = asyncio.run(_run(a.url.rstrip("/"), a))
    else:
        model_dir = resolve_model(a.model).directory
        extra = ["--dtype", a.dtype, "--max-model-len", "2048"]
        if a.kv_blocks:
            extra += ["--kv-blocks", str(a.kv_blocks)]
        with tempfile.TemporaryDirectory() as tmp:
            node = duet_node("both", str(model_dir), Path(tmp), *extra, threads=None)
            print(f"starting a node for {a.model} ...", file=sys.stderr)
            with running(node):
                report = asyncio.run(_run(node.url, a))
        report["model"] = a.model
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'phase':>12} | {'TTFT p50':>9} {'p95':>9} | {'bg tok/s':>9}")
    for name, ph in report["phases"].items():
        print(f"{name:>12} | {ph['ttft_p50_ms']:7.1f}ms {ph['ttft_p95_ms']:7.1f}ms | "
              f"{ph['background_tokens_per_s']:9.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
