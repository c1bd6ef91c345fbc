"""The gateway is SIGKILLed under load and restarted on the same store: every response a client
saw complete has its usage record, with the client's own token counts, and the only records no
client saw whole are of requests in flight at the kill."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import openai

from tests.gateway.helpers import MODEL, gateway_proc, make_team, tiny_model
from tests.procs import duet_node, running
from tests.wait import until

WORKERS = 8


async def _worker(url: str, key: str, seen: list[dict], stop: asyncio.Event, i: int) -> None:  # type: ignore[type-arg]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    k = 0
    while not stop.is_set():
        k += 1
        try:
            stream = await client.completions.create(
                model=MODEL,
                prompt=f"worker {i} request {k}",
                stream=True,
                max_tokens=4 + (i * 7 + k) % 20,
                temperature=0,
                stream_options={"include_usage": True},
            )
            chunk_id, usage = None, None
            async for chunk in stream:
                chunk_id = chunk.id
                usage = chunk.usage or usage
        except openai.APIError:
            return  # the gateway is gone
        # the stream ended with [DONE]: this client saw a complete response
        assert usage is not None
        seen.append(
            {"id": chunk_id, "prompt": usage.prompt_tokens, "completion": usage.completion_tokens}
        )


async def test_sigkill_under_load_loses_no_seen_usage(tiny_llama: Path, tmp_path: Path) -> None:
    both = duet_node(
        "both",
        tiny_llama,
        tmp_path,
        "--dtype",
        "float32",
        "--kv-blocks",
        "256",
        "--max-model-len",
        "1024",
    )
    store = tmp_path / "gateway.db"
    g1 = gateway_proc(tmp_path, {MODEL: tiny_model(tiny_llama, both=[both.url])}, store=store)
    with running(both, g1):
        key = make_team(g1.url, "load")
        seen: list[dict] = []  # type: ignore[type-arg]
        stop = asyncio.Event()
        workers = [
            asyncio.ensure_future(_worker(g1.url, key, seen, stop, i)) for i in range(WORKERS)
        ]
        await until(
            lambda: len(seen) >= 40 or all(w.done() for w in workers), 300, "40 complete responses"
        )
        assert len(seen) >= 40, "every worker stopped before the kill"
        g1.kill()  # SIGKILL, mid-load
        stop.set()
        await asyncio.gather(*workers)
        g2 = gateway_proc(
            tmp_path, {MODEL: tiny_model(tiny_llama, both=[both.url])}, port=g1.port, store=store
        )
        with running(g2):
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
                    "load",
                    "--format",
                    "json",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
    records = {r["request_id"].removeprefix("req-"): r for r in json.loads(out.stdout)}
    for s in seen:
        r = records.get(s["id"].removeprefix("cmpl-"))
        assert r is not None, f"{s['id']} was seen complete by its client but has no usage record"
        assert (r["status"], r["prompt_tokens"], r["completion_tokens"]) == (
            "ok",
            s["prompt"],
            s["completion"],
        )
    seen_ids = {s["id"].removeprefix("cmpl-") for s in seen}
    assert sum(r["completion_tokens"] for k, r in records.items() if k in seen_ids) == sum(
        s["completion"] for s in seen
    )
    unseen = [r for k, r in records.items() if k not in seen_ids]
    assert len(unseen) <= WORKERS  # at most the requests in flight when the gateway died
