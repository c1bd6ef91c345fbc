"""`GET /v1/usage?group_by=record` is always one page: a team key asking for its whole history
gets at most the page cap per call and a `next` to go on with, never every record at once, and
the records leave the store already converted in its worker thread, not on the event loop every
team's streams share.

Real parts: the gateway app on a real socket in this process, its SQLite store holding 3000 of
one team's records (written through the store, as settlements write them), read with that team's
key.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.accounts.store import sqlite as sqlite_store
from gateway.accounts.store.base import Settlement, UsageRecord
from gateway.api import admin
from gateway.app import STATE, make_app
from gateway.config import parse_config
from tests.gateway.helpers import ADMIN_KEY

RECORDS = 3000
#: a cap below the records held, so one call could hand out more than it if nothing bounded it
CAP = 1200


def records(n: int) -> list[UsageRecord]:
    return [
        UsageRecord(
            request_id=f"r{i:05d}",
            team_id="big",
            key_id="k",
            model_requested="tiny",
            model_used="tiny",
            tier="interactive",
            status="ok",
            prompt_tokens=10,
            completion_tokens=5,
            nodes=["n1", "n2"],
            created_at=1_700_000_000 + i // 3,  # ties: the cursor orders by request id within them
        )
        for i in range(n)
    ]


async def test_record_usage_is_paged_and_converted_off_the_loop(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admin, "RECORDS_PAGE_MAX", CAP)
    monkeypatch.setattr(admin, "RECORDS_PAGE_DEFAULT", 1000, raising=False)
    converted_on: set[str] = set()  # the threads the store's rows became records on
    record_of = sqlite_store.record_of

    def watched(row: Any) -> UsageRecord:
        converted_on.add(threading.current_thread().name)
        return record_of(row)

    monkeypatch.setattr(sqlite_store, "record_of", watched)
    cfg = parse_config(
        {
            "store": {"url": f"sqlite://{tmp_path / 'g.db'}"},
            "server": {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()},
            "models": {
                "tiny": {"tokenizer": str(tiny_llama), "static": {"both": ["http://127.0.0.1:9"]}}
            },
        }
    )
    app = make_app(cfg)
    async with TestClient(TestServer(app)) as client:
        admin_h = {"Authorization": f"Bearer {ADMIN_KEY}"}
        r = await client.post("/admin/teams", json={"id": "big"}, headers=admin_h)
        assert r.status == 201, await r.text()
        r = await client.post("/admin/keys", json={"team_id": "big", "name": "k"}, headers=admin_h)
        assert r.status == 201, await r.text()
        team_h = {"Authorization": f"Bearer {(await r.json())['key']}"}
        written = records(RECORDS)
        store = app[STATE].store
        for i in range(0, RECORDS, 500):
            await store.settle([Settlement(None, rec) for rec in written[i : i + 500]])

        # the attack: the whole history, no limit: the default page and a way on, not 3000 rows
        r = await client.get("/v1/usage?group_by=record&start=0", headers=team_h)
        assert r.status == 200, await r.text()
        body = await r.json()
        assert len(body["data"]) == 1000 and body["next"], (len(body["data"]), body.get("next"))
        assert converted_on and threading.main_thread().name not in converted_on, converted_on
        # a limit above the cap is refused; at the cap, pages of at most the cap follow `next`
        r = await client.get(f"/v1/usage?group_by=record&start=0&limit={CAP + 1}", headers=team_h)
        assert r.status == 400 and (await r.json())["error"]["param"] == "limit"
        seen = [row["request_id"] for row in body["data"]]
        after = body["next"]
        sizes = []
        while after:
            r = await client.get(
                "/v1/usage",
                params={"group_by": "record", "start": "0", "limit": str(CAP), "after": after},
                headers=team_h,
            )
            assert r.status == 200, await r.text()
            page = await r.json()
            sizes.append(len(page["data"]))
            seen += [row["request_id"] for row in page["data"]]
            after = page["next"]
        assert sizes == [CAP, RECORDS - 1000 - CAP], sizes
        assert seen == [rec.request_id for rec in written]  # every record once, in order
        assert page["data"][0]["nodes"] == "n1 n2"  # the report rows' shape is kept
