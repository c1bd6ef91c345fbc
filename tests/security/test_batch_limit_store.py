"""The batch tier's per-team bounds are held by the store, in the write's own transaction:
creations and uploads racing each other — on one gateway or on several sharing the
database — cannot pass `max_open_batches` or `max_team_bytes` together. Before, the bounds were
read in one transaction and the write done in another, so every racer that read before the
first write passed.

Real parts: the batch store on SQLite (one connection per "gateway", each on its own thread)
and on a real PostgreSQL server (one pool per "gateway"); the calls run concurrently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.accounts.store.batch_tables import TeamLimit
from gateway.batch.config import BatchConfig
from gateway.batch.files import FileStore
from gateway.batch.rows import FileRow, NewRequest
from gateway.batch.submit import submit_batch
from protocol.openai import APIError
from tests.batch.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.batch.test_store import batch, open_store  # noqa: F401  (the store on both backends)

GATEWAYS = 4


async def _outcome(call: Any) -> str:
    try:
        await call
        return "written"
    except TeamLimit as e:
        return e.kind


async def test_racing_creations_hold_the_open_bound(tmp_path: Path, open_store: Any) -> None:  # noqa: F811
    stores = [open_store(tmp_path / "db.sqlite3") for _ in range(GATEWAYS)]
    try:
        lines = [NewRequest(line=1, custom_id="c", body={"model": "m", "prompt": "x"})]
        calls = [
            stores[i % GATEWAYS].create_batch(
                dataclasses.replace(batch(f"batch_{i}", 0.0), team_id="t"), lines, max_open=3
            )
            for i in range(12)
        ]
        outcomes = await asyncio.gather(*(_outcome(c) for c in calls))
        assert outcomes.count("written") == 3 and outcomes.count("open_batches") == 9, outcomes
        # (the three batches' request bodies count in the team's bytes while they run)
        assert await stores[0].team_holdings("t") == (3 * len('{"model": "m", "prompt": "x"}'), 3)
        # Another team has its own bound; a failed batch holds none.
        await stores[1].create_batch(
            dataclasses.replace(batch("batch_u", 0.0), team_id="u"), lines, max_open=3
        )
        failed = dataclasses.replace(batch("batch_f", 0.0), team_id="t", status="failed")
        await stores[2].create_batch(failed, [], max_open=3)
    finally:
        for s in stores:
            s.close()


async def test_racing_submissions_hold_the_open_bound(tmp_path: Path, open_store: Any) -> None:  # noqa: F811
    """What the routes call (`submit_batch`: its early count, the input file read, the insert),
    twelve at once through four gateways: exactly three batches. The old code passed the count
    in every racer that read it before the first insert."""
    config = BatchConfig(data_dir=tmp_path, models=frozenset({"m"}), max_open_batches=3)
    files = FileStore(config.files_dir)
    line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "x"},
    }
    files.write("file-in", [json.dumps(line).encode() + b"\n"])
    stores = [open_store(tmp_path / "db.sqlite3") for _ in range(GATEWAYS)]

    async def submit(i: int) -> str:
        try:
            await submit_batch(
                stores[i % GATEWAYS],
                files,
                config,
                team_id="t",
                kind="openai",
                endpoint="/v1/completions",
                input_file_id="file-in",
                window="24h",
                metadata=None,
            )
            return "made"
        except APIError as e:
            assert e.status == 429 and e.code == "too_many_open_batches", e.body()
            return "refused"

    try:
        outcomes = await asyncio.gather(*(submit(i) for i in range(12)))
        assert outcomes.count("made") == 3, outcomes
        assert (await stores[0].team_holdings("t"))[1] == 3  # (bytes: the bodies they hold)
    finally:
        for s in stores:
            s.close()


async def test_racing_uploads_hold_the_storage_bound(tmp_path: Path, open_store: Any) -> None:  # noqa: F811
    stores = [open_store(tmp_path / "db.sqlite3") for _ in range(GATEWAYS)]
    try:

        def row(i: int) -> FileRow:
            return FileRow(
                id=f"file-{i}",
                team_id="t",
                purpose="batch",
                filename="a.jsonl",
                bytes=100,
                created_at=0.0,
            )

        outcomes = await asyncio.gather(
            *(
                _outcome(stores[i % GATEWAYS].insert_file(row(i), max_team_bytes=350))
                for i in range(12)
            )
        )
        assert outcomes.count("written") == 3 and outcomes.count("bytes") == 9, outcomes
        assert (await stores[0].team_holdings("t"))[0] == 300
        with pytest.raises(TeamLimit) as e:
            await stores[1].insert_file(dataclasses.replace(row(99), bytes=51), max_team_bytes=350)
        assert e.value.held == 300
        await stores[1].insert_file(
            dataclasses.replace(row(98), bytes=50), max_team_bytes=350
        )  # exactly full
    finally:
        for s in stores:
            s.close()
