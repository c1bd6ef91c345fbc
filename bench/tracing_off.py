"""`python -m bench.tracing_off`: what tracing costs the gateway when it is off.

Starts a token-echo node and a `duet gateway` with tracing off under cProfile, sends
`--requests` sequential streamed completions, stops the gateway (which writes its profile) and
reports how many calls per request went into `runtime/tracing/` and what share of the
gateway's profiled time they took. cProfile inflates small functions, so the share is an upper
bound. `python -m bench.gateway --traced --otlp` measures the other side: tracing on, with and
without an OTLP exporter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from bench.gateway import PROMPT, _admin, _stream, _write_config
from bench.procs import Proc, free_port, running
from runtime.models import DEFAULT_MODEL, resolve_model

#: the tracing package's files, as a profile names them
TRACING_DIR = f"{os.sep}runtime{os.sep}tracing{os.sep}"


def run(requests: int, tokenizer: str) -> dict[str, Any]:
    tok = resolve_model(tokenizer).directory
    with tempfile.TemporaryDirectory(prefix="duet-bench-tracing-off-") as d:
        tmp = Path(d)
        nport, sport, gport = free_port(), free_port(), free_port()
        node = Proc(
            [sys.executable, "-m", "bench.echo_node", "--port", str(nport)], nport, tmp / "echo.log"
        )
        slow = Proc(
            [sys.executable, "-m", "bench.echo_node", "--port", str(sport)], sport, tmp / "slow.log"
        )
        cfg = _write_config(tmp, gport, node.url, slow.url, str(tok), 100, 3.0)
        admin = secrets.token_urlsafe(32)
        prof = tmp / "gateway.prof"
        gw = Proc(
            [
                sys.executable,
                "-m",
                "cProfile",
                "-o",
                str(prof),
                "-m",
                "duet",
                "gateway",
                "--config",
                str(cfg),
                "--log-level",
                "WARNING",
            ],
            gport,
            tmp / "gateway.log",
            env={"DUET_ADMIN_KEY": admin, "DUET_HOME": str(tmp), "OTEL_SDK_DISABLED": "true"},
        )
        with running(node, slow, gw):
            _admin(gw.url, admin, "/admin/teams", {"id": "bench"})
            key = _admin(gw.url, admin, "/admin/keys", {"team_id": "bench"})["key"]

            async def send() -> None:
                body = {
                    "model": "echo",
                    "prompt": PROMPT,
                    "max_tokens": 16,
                    "stream": True,
                    "temperature": 0,
                }
                async with aiohttp.ClientSession() as s:
                    for _ in range(requests):
                        await _stream(
                            s, gw.url + "/v1/completions", body, {"Authorization": f"Bearer {key}"}
                        )

            asyncio.run(send())
        # the gateway has stopped (SIGTERM: a clean exit), so cProfile has written its file
        stats = pstats.Stats(str(prof))
        calls: dict[str, int] = {}
        seconds = 0.0
        for (path, _, name), (_, ncalls, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
            if TRACING_DIR in path:
                calls[name] = calls.get(name, 0) + ncalls
                seconds += tottime
        total = stats.total_tt  # type: ignore[attr-defined]
    return {
        "bench": "tracing_off",
        "requests": requests,
        "gateway_profiled_s": round(total, 3),
        "tracing_s": round(seconds, 4),
        "tracing_calls_per_request": round(sum(calls.values()) / requests, 1),
        "tracing_us_per_request": round(seconds * 1e6 / requests, 2),
        "tracing_share": round(seconds / total, 5),
        "calls": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.tracing_off",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=1000, help="sequential streamed requests")
    p.add_argument(
        "--tokenizer", default=DEFAULT_MODEL, help="model whose tokenizer the gateway uses"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    out = run(args.requests, args.tokenizer)
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"tracing off, {out['requests']} requests: {out['tracing_calls_per_request']} calls "
            f"per request into runtime/tracing/, {out['tracing_us_per_request']} µs per request, "
            f"{out['tracing_share']:.3%} of the gateway's profiled time (cProfile: an upper bound)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
