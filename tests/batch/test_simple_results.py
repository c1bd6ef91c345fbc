"""`GET /v1/batch/{id}` pages an ended batch's results from its files (`limit`, `after` =
the last page's `next_after`) instead of loading every result inline on every poll. Through
HTTP against the batch routes and runner, the cancel through the official openai client; the
runner is held (`may_run` False), so the cancelled batch's lines all end in its error file and
no model runs."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import aiohttp

from gateway.batch.config import BatchConfig
from tests.batch.app import make_app
from tests.batch.conftest import client
from tests.wait import until

N = 7


async def test_results_come_a_page_at_a_time(tmp_path: Path, tiny_llama: Path, serve: Any) -> None:
    config = BatchConfig(data_dir=tmp_path, models=frozenset({"m"}), poll_s=0.05)
    app = make_app(
        config, node_url="http://127.0.0.1:9", model_dir=tiny_llama, may_run=lambda: False
    )
    url = await serve(app)
    reqs = [{"model": "m", "prompt": f"p{i}", "max_tokens": 1} for i in range(N)]
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as s:

        async def get(query: str = "") -> tuple[int, dict[str, Any]]:
            async with s.get(f"{url}/v1/batch/{bid}{query}") as r:
                return r.status, await r.json()

        async with s.post(url + "/v1/batch", json={"requests": reqs}) as r:
            assert r.status == 202, await r.text()
            bid = (await r.json())["batch_id"]
        async with client(url) as c:
            await c.batches.cancel(bid)

        async def ended() -> bool:
            return (await get())[1]["status"] == "cancelled"

        await until(ended, what="the cancelled batch finalized")
        seen: list[str] = []
        pages = 0
        query = "?limit=3"
        while True:
            status, page = await get(query)
            assert status == 200 and len(page["results"]) <= 3, page
            seen += [x["custom_id"] for x in page["results"]]
            assert all(x["error"]["code"] == "batch_cancelled" for x in page["results"])
            pages += 1
            if page["next_after"] is None:
                break
            query = f"?limit=3&after={page['next_after']}"
        assert seen == [f"request-{i}" for i in range(1, N + 1)] and pages == 3
        # the ended batch's lines left the store: its results are its files'
        with sqlite3.connect(tmp_path / "batch.sqlite3") as db:
            assert db.execute("SELECT COUNT(*) FROM batch_requests").fetchone() == (0,)
        # the default page holds them all; a bad limit or cursor is a 400, not a full read
        assert len((await get())[1]["results"]) == N
        for bad in ("?limit=0", "?limit=1001", "?limit=x", "?after=2.0", "?after=abc"):
            status, body = await get(bad)
            assert status == 400 and body["error"]["param"] in ("limit", "after"), (bad, body)
