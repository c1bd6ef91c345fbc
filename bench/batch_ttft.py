"""`python -m bench.batch_ttft`: what a running batch costs interactive users, through the gateway.

Measures interactive time to first token (streamed `/v1/completions` through the gateway) in
three phases:

  idle          interactive requests alone, one at a time
  batch         the same, while a Batch API job (Files + Batches, uploaded through the gateway)
                runs: the gateway's batch runner, at the batch tier, yielding to interactive load
  no_priority   the same load sent as --batch-streams loops of interactive requests, i.e.
                what the work would cost without the batch tier

and the background's throughput (completion tokens/s) in the last two. Fresh random token
prompts (no prefix-cache hits); background lines use ignore_eos, so each yields exactly
--batch-max-tokens tokens. Starts a colocated node and a gateway (batch concurrency =
--batch-streams) unless --gateway names a running one (then --api-key and --model too).
Medians and p95 over --interactive requests per phase; one JSON object with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import Proc, duet_node, free_port, running
from runtime.models import DEFAULT_MODEL, resolve_model

_TERMINAL = ("completed", "failed", "expired", "cancelled")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.batch_ttft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--gateway", default=None, help="a running gateway's URL (default: start node + gateway)"
    )
    p.add_argument("--api-key", default=None, help="a team's key on --gateway")
    p.add_argument(
        "--model",
        default=None,
        help="model name on --gateway, or the model to serve "
        f"when starting one (default {DEFAULT_MODEL})",
    )
    p.add_argument("--interactive", type=int, default=20, help="interactive requests per phase")
    p.add_argument("--prompt-len", type=int, default=128, help="interactive prompt tokens")
    p.add_argument("--max-tokens", type=int, default=8, help="interactive completion tokens")
    p.add_argument(
        "--batch-streams",
        type=int,
        default=4,
        help="background requests at once (the started gateway's [batch] concurrency)",
    )
    p.add_argument(
        "--batch-lines",
        type=int,
        default=2000,
        help="lines in the batch job (enough to outlast a phase)",
    )
    p.add_argument("--batch-prompt-len", type=int, default=256)
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto", help="node dtype (when starting one)")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="node KV pool size in blocks (when starting one)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    if a.gateway and not (a.api_key and a.model):
        p.error("--gateway needs --api-key and --model")
    return a


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 300) for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


class _Gateway:
    def __init__(self, s: aiohttp.ClientSession, url: str, key: str, model: str) -> None:
        self.s, self.url, self.model = s, url.rstrip("/"), model
        self.h = {"Authorization": f"Bearer {key}"}

    async def ttft(self, prompt: list[int], max_tokens: int) -> float:
        """One streamed interactive completion; seconds to its first content chunk."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.perf_counter()
        first = None
        async with self.s.post(f"{self.url}/v1/completions", json=body, headers=self.h) as r:
            if r.status != 200:
                raise RuntimeError(f"interactive request failed: {r.status} {await r.text()}")
            async for raw in r.content:
                line = raw.strip()
                if (
                    first is None
                    and line.startswith(b"data: {")
                    and json.loads(line[6:]).get("choices")
                ):
                    first = time.perf_counter() - t0
        if first is None:
            raise RuntimeError("interactive request streamed no content")
        return first

    async def whole(self, prompt: list[int], max_tokens: int) -> int:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with self.s.post(f"{self.url}/v1/completions", json=body, headers=self.h) as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"background request failed: {r.status} {data}")
        return int(data["usage"]["completion_tokens"])

    async def call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        async with self.s.request(method, f"{self.url}{path}", headers=self.h, **kw) as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{method} {path}: {r.status} {data}")
            return data


async def _interactive(g: _Gateway, a: argparse.Namespace, name: str, seed: int) -> list[float]:
    rng = random.Random(seed)
    out = []
    for i in range(a.interactive):
        out.append(await g.ttft(_prompt(rng, a.prompt_len), a.max_tokens))
        print(f"\r  {name}: {i + 1}/{a.interactive}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return out


def _summary(ttfts: list[float], tokens: int, elapsed: float, loaded: bool) -> dict[str, Any]:
    return {
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p95_ms": _pct(ttfts, 0.95) * 1e3,
        "ttft_mean_ms": statistics.fmean(ttfts) * 1e3,
        "requests": len(ttfts),
        "background_tokens_per_s": tokens / elapsed if loaded else 0.0,
    }


async def _batch_phase(g: _Gateway, a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(2000)
    lines = b"".join(
        json.dumps(
            {
                "custom_id": f"bg-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": g.model,
                    "prompt": _prompt(rng, a.batch_prompt_len),
                    "max_tokens": a.batch_max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        ).encode()
        + b"\n"
        for i in range(a.batch_lines)
    )
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", lines, filename="bench.jsonl", content_type="application/jsonl")
    f = await g.call("POST", "/v1/files", data=form)
    b = await g.call(
        "POST",
        "/v1/batches",
        json={"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
    )
    bid = b["id"]
    try:
        while (b := await g.call("GET", f"/v1/batches/{bid}"))["request_counts"]["completed"] < 1:
            if b["status"] in _TERMINAL:
                raise RuntimeError(f"the background batch ended before the phase: {b}")
            await asyncio.sleep(0.1)  # poll: the batch reports progress only through its object
        done0, t0 = b["request_counts"]["completed"], time.perf_counter()
        ttfts = await _interactive(g, a, "batch", 2)
        b = await g.call("GET", f"/v1/batches/{bid}")
        elapsed = time.perf_counter() - t0
        if b["status"] in _TERMINAL:
            raise RuntimeError("the batch ran out during the phase: raise --batch-lines")
        tokens = (b["request_counts"]["completed"] - done0) * a.batch_max_tokens
    finally:
        await g.call("POST", f"/v1/batches/{bid}/cancel")
        while (await g.call("GET", f"/v1/batches/{bid}"))["status"] not in _TERMINAL:
            await asyncio.sleep(0.1)  # in-flight lines finish before the next phase starts
    return {**_summary(ttfts, tokens, elapsed, True), "batch_id": bid}


async def _loop_phase(g: _Gateway, a: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    tokens: list[int] = []

    async def loop(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            tokens.append(await g.whole(_prompt(rng, a.batch_prompt_len), a.batch_max_tokens))

    bg = [asyncio.create_task(loop(3000 + i)) for i in range(a.batch_streams)]
    t0 = time.perf_counter()
    try:
        ttfts = await _interactive(g, a, "no_priority", 3)
    finally:
        elapsed = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*bg)
    return _summary(ttfts, sum(tokens), elapsed, True)


async def _run(url: str, key: str, model: str, a: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        g = _Gateway(s, url, key, model)
        await g.ttft(list(range(10, 10 + a.prompt_len)), 2)  # warm-up: kernel caches, connections
        t0 = time.perf_counter()
        idle = await _interactive(g, a, "idle", 1)
        phases = {
            "idle": _summary(idle, 0, time.perf_counter() - t0, False),
            "batch": await _batch_phase(g, a),
            "no_priority": await _loop_phase(g, a),
        }
    base = phases["idle"]["ttft_p50_ms"]
    return {
        "gateway": url,
        "model": model,
        "interactive": a.interactive,
        "batch_streams": a.batch_streams,
        "prompt_len": a.prompt_len,
        "batch_prompt_len": a.batch_prompt_len,
        "batch_max_tokens": a.batch_max_tokens,
        "phases": phases,
        "ttft_p50_ratio_batch_vs_idle": phases["batch"]["ttft_p50_ms"] / base,
        "ttft_p50_ratio_no_priority_vs_idle": phases["no_priority"]["ttft_p50_ms"] / base,
    }


def _admin(url: str, admin: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _own_cluster(a: argparse.Namespace) -> dict[str, Any]:
    name = a.model or DEFAULT_MODEL
    model_dir = resolve_model(name).directory
    extra = ["--dtype", a.dtype, "--max-model-len", "2048"] + (
        ["--kv-blocks", str(a.kv_blocks)] if a.kv_blocks else []
    )
    with tempfile.TemporaryDirectory(prefix="duet-bench-batch-") as d:
        tmp = Path(d)
        node = duet_node("both", str(model_dir), tmp, *extra, threads=None)
        port, admin = free_port(), secrets.token_urlsafe(32)
        cfg = tmp / "gateway.toml"
        cfg.write_text(f"""[server]
port = {port}
[store]
url = "sqlite://{tmp / "gateway.db"}"
[batch]
concurrency = {a.batch_streams}
poll_s = 0.05
[models.{json.dumps(name)}]
tokenizer = {json.dumps(str(model_dir))}
static = {{ both = [{json.dumps(node.url)}] }}
""")
        gw = Proc(
            [
                sys.executable,
                "-m",
                "duet",
                "gateway",
                "--config",
                str(cfg),
                "--log-level",
                "WARNING",
            ],
            port,
            tmp / "gateway.log",
            env={"DUET_ADMIN_KEY": admin, "DUET_HOME": str(tmp)},
        )
        print(f"starting a node for {name} and a gateway ...", file=sys.stderr)
        with running(node, gw):
            _admin(gw.url, admin, "/admin/teams", {"id": "bench"})
            key = _admin(gw.url, admin, "/admin/keys", {"team_id": "bench"})["key"]
            return asyncio.run(_run(gw.url, key, name, a))


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    report = asyncio.run(_run(a.gateway, a.api_key, a.model, a)) if a.gateway else _own_cluster(a)
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'phase':>12} | {'TTFT p50':>9} {'p95':>9} | {'bg tok/s':>9}")
    for name, ph in report["phases"].items():
        print(
            f"{name:>12} | {ph['ttft_p50_ms']:7.1f}ms {ph['ttft_p95_ms']:7.1f}ms | "
            f"{ph['background_tokens_per_s']:9.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
