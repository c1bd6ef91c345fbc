"""What a batch holds in the store counts in its team's `max_team_bytes`: the request bodies it
copied and the results its lines wrote, until the batch ends (then its output files count).
A team near its bound cannot grow the store with results it never pays storage for. Both
stores: SQLite and a real PostgreSQL (pgserver)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.accounts.store.batch_tables import TeamLimit
from gateway.batch.rows import FileRow, NewRequest
from tests.batch.test_store import batch, open_store  # noqa: F401  (both stores)

BODY = json.dumps({"model": "m", "prompt": "x"})
ANSWER = {"choices": [{"text": "y" * 20_000}]}


async def test_results_count_until_the_batch_ends(tmp_path: Path, open_store: Any) -> None:  # noqa: F811
    s = open_store(tmp_path / "db.sqlite3")
    try:
        await s.create_batch(batch("batch_1", 0.0), [NewRequest(line=1, custom_id="c", body=BODY)])
        assert (await s.team_holdings("t"))[0] == len(BODY)
        [c] = await s.claim_requests("A", 1, lease_s=10, now=1.0)
        assert await s.finish_request(
            "A",
            c.batch_id,
            "c",
            ok=True,
            status_code=200,
            request_id="r",
            response=ANSWER,
            error=None,
            now=2.0,
        )
        held = len(BODY) + len(json.dumps(ANSWER))
        assert (await s.team_holdings("t"))[0] == held
        # the bound sees them: a file that fits beside the body alone is refused
        f = FileRow(
            id="file-1", team_id="t", purpose="batch", filename="f", bytes=100, created_at=2.0
        )
        with pytest.raises(TeamLimit):
            await s.insert_file(f, max_team_bytes=len(BODY) + 10_000)
        assert await s.claim_finalizable("A", 10, now=3.0) == ["batch_1"]
        out = FileRow(
            id="file-out",
            team_id="t",
            purpose="batch_output",
            filename="o",
            bytes=held // 2,
            created_at=3.0,
        )
        assert await s.finish_batch("A", "batch_1", "completed", [out], "file-out", None, 3.0)
        assert (await s.team_holdings("t"))[0] == held // 2  # the output file alone
    finally:
        s.close()
