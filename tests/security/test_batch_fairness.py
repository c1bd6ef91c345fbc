"""Batch lines of different teams are claimed fairly: one team's huge batch, queued
first, cannot starve another team's small batch queued after it. Claims go round-robin over
teams (oldest batch, then line order, within a team); the old global FIFO gave every claim
to the first team until its whole batch had run.

Real parts: the batch store on SQLite (two connections, as two gateways) and on a real
PostgreSQL server; claims with explicit clocks. And a `duet gateway` process whose runner takes
one line at a time (concurrency 1), driven by the official openai client, the model a local fake
provider that records the order lines reach it. That run found a second way to starve: with
nothing running, every team's next line had turn 1 and the oldest batch won each tie, so claims
made one after another (each after the last line finished) served the first team's whole batch
before the second team's first line. Ties now go to the team whose last line started longest ago
(never: first).
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.batch.rows import NewRequest
from tests.batch.conftest import jsonl, postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.batch.test_store import batch, open_store  # noqa: F401  (the store on both backends)
from tests.gateway.helpers import gateway_proc, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running
from tests.providers.fakes import API_KEY
from tests.wait import wait_for


def _lines(n: int) -> list[NewRequest]:
    return [
        NewRequest(line=i + 1, custom_id=f"c{i}", body={"model": "m", "prompt": "x"})
        for i in range(n)
    ]


@pytest.mark.parametrize("claim", [4, 1])
async def test_a_huge_batch_cannot_starve_another_team(
    tmp_path: Path,
    open_store: Any,  # noqa: F811
    claim: int,
) -> None:
    s = open_store(tmp_path / "db.sqlite3")
    other = open_store(tmp_path / "db.sqlite3")  # a second gateway on the same store
    try:
        await s.create_batch(
            dataclasses.replace(batch("batch_huge", 0.0), team_id="a"), _lines(500)
        )
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
        assert mine == sorted(mine, key=lambda x: (x[0] != "batch_huge", x[1])) and mine[0] == (
            "batch_huge",
            1,
        )
        assert len({(c.batch_id, c.custom_id) for c in got}) == len(got)  # nothing claimed twice
    finally:
        s.close()
        other.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_lines_claimed_one_after_another_alternate_between_teams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, backend: str
) -> None:
    servers = FakeServers({"gpt": "openai"})
    gpt = servers.fakes["gpt"]
    held = threading.Event()  # the first line waits at the provider until team b has submitted

    def reply(body: dict[str, Any]) -> str:
        if len(gpt.requests) == 1:
            assert held.wait(120), "the test never let the first line go"
        return "ok"

    gpt.reply = reply
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    store = request.getfixturevalue("postgres_db") if backend == "postgres" else None
    batch_cfg = {
        "data_dir": str(tmp_path / "batch"),
        "concurrency": 1,
        "lease_s": 30.0,
        "poll_s": 0.05,
    }
    gw = gateway_proc(
        tmp_path, {"gpt": external(gpt, {"in": 1.0, "out": 1.0}, 2)}, store=store, batch=batch_cfg
    )

    def lines(team: str, n: int) -> bytes:
        return jsonl(
            [
                {
                    "custom_id": f"{team}{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "gpt",
                        "messages": [{"role": "user", "content": f"{team}{i}"}],
                        "max_tokens": 4,
                    },
                }
                for i in range(n)
            ]
        )

    try:
        with running(gw):
            teams = {
                t: openai.OpenAI(
                    base_url=gw.url + "/v1", api_key=make_team(gw.url, t), max_retries=0, timeout=60
                )
                for t in ("a", "b")
            }
            ids = {}
            for team, n in (("a", 12), ("b", 2)):
                c = teams[team]
                f = c.files.create(file=(f"{team}.jsonl", lines(team, n)), purpose="batch")
                ids[team] = c.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                ).id
                if team == "a":
                    wait_for(
                        lambda: len(gpt.requests) == 1, 60, "team a's first line at the provider"
                    )
            held.set()
            for team, c in teams.items():
                wait_for(
                    lambda c=c, team=team: c.batches.retrieve(ids[team]).status == "completed",
                    120,
                    f"team {team}'s batch to complete",
                )
    finally:
        held.set()
        servers.close()
    order = [r["messages"][-1]["content"] for r in gpt.requests]
    assert sorted(order) == sorted([f"a{i}" for i in range(12)] + ["b0", "b1"])  # each line once
    # Old code: a0..a11 (team a's whole batch), then b0, b1.
    assert order[:4] == ["a0", "b0", "a1", "b1"], order
