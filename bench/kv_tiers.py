"""`python -m bench.kv_tiers`: what the KV hierarchy's pieces cost on this machine, against the
prefill they save.

In one process, on the engine's own pool (SmolLM2 by default; its layout, dtype and block size):
- a `--prompt-len`-token prefill (the unit every cost is priced in: ms per prompt token), and the
  content digests that prefill takes (one per full block) timed on the same blocks, alternating
  rep by rep: their share of the prefill is the digest's cost on the write path;
- per block: a digest alone, a spill to the host tier and its load back (copy + digest), a spill
  to the disk tier and its load back (write, read, digest), a plain copy of a block;
- the token-equivalent weights the router prices reuse with (coordinator/kv_reuse.py KVCosts):
  a block's load cost over its block of prefill.
Figures are medians over `--reps`; the JSON (`--json`) carries every sample's median and p10/p90.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.stats import spread
from engine import EngineConfig, SamplingParams
from engine.core import EngineCore
from engine.kv_stores import DiskStore, HostStore
from engine.kv_tiers import KVTiers
from runtime.models import DEFAULT_MODEL


def _timed(fn: Any, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _prefill(core: EngineCore, prompt: list[int], rid: str) -> float:
    t0 = time.perf_counter()
    core.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0))
    while core.has_unfinished():
        core.step()
    return time.perf_counter() - t0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    core = EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            threads=args.threads,
            num_kv_blocks=args.prompt_len // 16 * 4 + 16,
            max_model_len=args.prompt_len * 2,
            enable_prefix_caching=False,  # every rep computes the whole prompt
        )
    )
    data, bs = core.pool_bytes, core.pool.block_size
    blocks = list(range(args.prompt_len // bs))
    vocab = core.model_config.vocab_size
    prompts = [
        [(i * 7 + r * 131) % (vocab - 10) + 5 for i in range(args.prompt_len)] for r in range(3)
    ]
    _prefill(core, prompts[0], "warm")
    prefill_s, digests_s = [], []
    for r in range(args.reps):  # alternate: the machine's noise hits both alike
        prefill_s.append(_prefill(core, prompts[r % 3], f"p{r}"))
        t0 = time.perf_counter()
        for b in blocks:
            data.digest(b, b, 1)
        digests_s.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        per_block = _per_block(core, Path(tmp), args.reps)
    t_prefill = statistics.median(prefill_s)
    per_token = t_prefill / args.prompt_len
    out = {
        "model": core.model_name,
        "dtype": core.runner.kv_layout.dtype,
        "block_bytes": data.block_bytes,
        "block_size": bs,
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "prefill_ms": spread([x * 1e3 for x in prefill_s]),
        "prefill_digests_ms": spread([x * 1e3 for x in digests_s]),
        "digest_share_of_prefill": statistics.median(digests_s) / t_prefill,
        "per_block_us": {k: spread([x * 1e6 for x in v]) for k, v in per_block.items()},
    }
    med = {k: statistics.median(v) for k, v in per_block.items()}
    block_prefill = per_token * bs
    out["token_equivalents"] = {
        "host_token": med["host_load"] / block_prefill,
        "disk_token": med["disk_load"] / block_prefill,
        "digest_per_token": med["digest"] / block_prefill,
    }
    return out


def _per_block(core: EngineCore, tmp: Path, reps: int) -> dict[str, list[float]]:
    """Spill and load one block through each tier, a digest, and a plain copy: seconds each."""
    data = core.pool_bytes
    host = HostStore(2, data.block_bytes)
    tiers = KVTiers(data, core.pool.block_size, host, DiskStore(tmp, data.block_bytes), 4)
    scratch = memoryview(bytearray(data.block_bytes))
    got: dict[str, list[float]] = {k: [] for k in ("digest", "copy", "host_spill", "host_load")}
    got.update(disk_spill=[], disk_load=[])
    for r in range(reps):
        h = 1000 + r
        got["digest"] += _timed(lambda h=h: data.digest(0, h, 1), 1)
        got["copy"] += _timed(lambda: scratch.__setitem__(slice(None), data.view(0)), 1)
        got["host_spill"] += _timed(lambda h=h: tiers.spill(0, h, 7), 1)
        got["host_load"] += _timed(lambda h=h: (tiers.load(h, 1), data.digest(1, h, 1)), 1)
        tiers.host = None  # straight to disk this time
        got["disk_spill"] += _timed(lambda h=h: tiers.spill(0, h + 10**6, 7), 1)
        got["disk_load"] += _timed(
            lambda h=h: (tiers.load(h + 10**6, 1), data.digest(1, h + 10**6, 1)), 1
        )
        tiers.host = host
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_tiers", description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = measure(args)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"{out['model']} {out['dtype']}, {out['block_bytes']:,} bytes a block, "
        f"{args.threads} threads",
        file=sys.stdout,
    )
    p, d = out["prefill_ms"]["median"], out["prefill_digests_ms"]["median"]
    print(f"{args.prompt_len}-token prefill {p:.1f} ms; its digests {d:.2f} ms ({d / p:.2%})")
    for k, v in out["per_block_us"].items():
        print(f"  {k:10} {v['median']:8.1f} µs per block")
    for k, v in out["token_equivalents"].items():
        print(f"  {k:16} {v:.4f} token-equivalents")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
