"""Batch lines of different teams are claimed fairly (issue #22): one team's huge batch, queued
first, cannot starve another team's small batch queued after it. Claims go round-robin over
teams (oldest batch, then line order, within a team); the old global FIFO gave every claim
to the first team until its whole batch had run.

Real parts: the batch store on SQLite (two connections, as two gateways) and on a real
PostgreSQL server; claims with explicit clocks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gateway.batch.store import NewRequest
from tests.batch.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.batch.test_store import batch, open_store  # noqa: F401  (the store on both backends)


def _lines(n: int) -> list[NewRequest]:
    return [NewRequest(line=i + 1, custom_id=f"c{i}", body={"model": "m", "prompt": "x"}) for i in range(n)]


@pytest.mark.parametrize("claim", [4, 1])
async def test_a_huge_batch_cannot_starve_another_team(tmp_path: Path, open_store: Any,  # noqa: F811
                                                       claim: int) -> None:  # fmt: skip
    s = open_store(tmp_path / "db.sqlite3")
    other = open_store(tmp_path / "db.sqlite3")  # a second gateway on the same store
    try:
        await s.create_batch(dataclasses.replace(batch("batch_huge", 0.0), team_id="a"), _lines(500))
        await s.create_batch(dataclasses.replace(batch("batch_a2", 0.5), team_id="a"), _lines(3))
        await s.create_batch(dataclasses.replace(batch("batch_small", 1.0), team_id="b"), _lines(2))
        got = await s.claim_requests("A", claim, lease_s=60, now=2.0)
        got += await other.claim_requests("B", claim, lease_s=60, now=2.0)
        teams = [c.team_id for c in got]
        # Old code: 2×claim lines of team a's first batch, team b waits for all 500 lines.
        assert teams.count("b") == min(2, claim), teams
        assert teams.count("a") == len(got) - teams.count("b")
        # Within a team: its oldest batch first, in line order.
        mine = [(c.batch_id, c.line) for c in got if c.team_id == "a"]
        assert mine == sorted(mine, key=lambda x: (x[0] != "batch_huge", x[1])) and mine[0] == ("batch_huge", 1)
        assert len({(c.batch_id, c.custom_id) for c in got}) == len(got)  # nothing claimed twice
    finally:
        s.close()
        other.close()
