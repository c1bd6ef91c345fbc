"""A real `duet gateway` process with the batch tier on, in front of real tiny-model nodes, and
what the gateway batch tests read back: batch outputs, per-record usage (`duet usage report`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai

from tests.batch.conftest import client, jsonl
from tests.gateway.helpers import MODEL, gateway_proc, tiny_model
from tests.procs import Proc
from tests.wait import until

#: fraction off in the tests: not 0.5, so "fraction off" and "price factor" cannot be confused
DISCOUNT = 0.25
#: tiny_model's prices (USD per million tokens)
INPUT_PRICE, OUTPUT_PRICE = 1.0, 2.0
NODE_ARGS = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")


def batch_gateway(
    tmp: Path,
    tokenizer: Path,
    nodes: list[str],
    port: int | None = None,
    store: Path | str | None = None,
    **batch: Any,
) -> Proc:
    """`store`: the gateway store (default tmp/gateway.db; a postgresql:// URL for a shared one)."""
    settings = {
        "concurrency": 8,
        "discount": DISCOUNT,
        "lease_s": 3.0,
        "poll_s": 0.05,
        "retry_base_s": 0.2,
        **batch,
    }
    return gateway_proc(
        tmp,
        {MODEL: tiny_model(tokenizer, both=nodes)},
        port=port,
        store=store or tmp / "gateway.db",
        batch=settings,
    )


def lines_for(n: int, max_tokens: int = 4, **extra: Any) -> list[dict[str, Any]]:
    """n distinct short greedy chat requests for the gateway's model."""
    out = []
    for i in range(n):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"line {i} says {i * 37 % 101}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **extra,
        }
        out.append(
            {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return out


async def submit(c: openai.AsyncOpenAI, lines: list[dict[str, Any]]) -> str:
    f = await c.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    b = await c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return b.id


async def wait_done(url: str, key: str, batch_id: str, timeout: float = 300) -> Any:
    async with client(url, key) as c:

        async def done() -> bool:
            return (await c.batches.retrieve(batch_id)).status in (
                "completed",
                "failed",
                "expired",
                "cancelled",
            )

        await until(done, timeout=timeout, what=f"batch {batch_id} done")
        return await c.batches.retrieve(batch_id)


async def file_lines(url: str, key: str, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    async with client(url, key) as c:
        data = await (await c.files.content(file_id)).aread()
    return [json.loads(x) for x in data.splitlines() if x.strip()]


async def completed_at_least(url: str, key: str, batch_id: str, n: int) -> None:
    async with client(url, key) as c:

        async def enough() -> bool:
            return (await c.batches.retrieve(batch_id)).request_counts.completed >= n

        await until(enough, timeout=120, what=f"{n} lines done")


def usage_records(store: Path, team: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "duet",
            "usage",
            "report",
            "--store",
            f"sqlite://{store}",
            "--team",
            team,
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def full_price(prompt: int, completion: int) -> float:
    return (prompt * INPUT_PRICE + completion * OUTPUT_PRICE) / 1e6
