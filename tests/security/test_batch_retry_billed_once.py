"""A batch line retried after its answer broke off mid-way is billed once.

The fault: a line's first run reached a node, the node's stream was cut mid-answer (the
cluster's fault), the gateway billed that run `error_midstream` (its prompt) and answered 502;
the runner recorded a retry, which cleared the line's request id, so the retry ran — and was
billed — under a new id: two records for one output line, up to one per attempt. Now a recorded
retry keeps the line's id, and a batch line's usage record is keyed by it (the later settled run
replaces the earlier record, whose spend is taken back): one record, the run that answered.

Real parts: a tiny-model node process behind a relay that cuts the first stream after a few
events (tests/gateway/faults.py, the node stays up) and relays the rest whole; a `duet gateway`
process with the batch tier on, on SQLite and on PostgreSQL (pgserver); the official openai
client; usage read back through `GET /v1/usage`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.batch.conftest import client
from tests.batch.gateway_procs import NODE_ARGS, file_lines, lines_for, submit, wait_done
from tests.gateway.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.gateway.faults import KillRelay
from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, tiny_model
from tests.procs import Proc, duet_node, running


@pytest.fixture(scope="module")
def node(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    n = duet_node("both", tiny_llama, tmp_path_factory.mktemp("node"), *NODE_ARGS)
    with running(n):
        yield n


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The gateway store's URL (a fixture: PostgreSQL's is made before the test's loop runs)."""
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_db"))
    return f"sqlite://{tmp_path / 'gateway.db'}"


def _records(url: str, key: str) -> list[dict[str, Any]]:
    status, _, body = http(f"{url}/v1/usage?group_by=record&start=0&limit=100", key=key)
    assert status == 200, body
    return list(body["data"])


async def test_a_line_retried_after_a_cut_answer_is_billed_once(
    node: Proc,
    tiny_llama: Path,
    tmp_path: Path,
    relays: list[KillRelay],
    store: str,
) -> None:
    relay = await KillRelay(node, "after_chunks", 6, node_dies=False).start()
    relays.append(relay)
    batch = {"concurrency": 1, "lease_s": 3.0, "poll_s": 0.05, "retry_base_s": 0.2}
    g = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama, both=[relay.url])},
        store=store,
        batch=batch,
        routing={"max_migrations": 0},  # the cut answer is a 502, not moved to another leg
    )
    with running(g):
        key = make_team(g.url, "retried")
        async with client(g.url, key) as c:
            batch_id = await submit(c, lines_for(1, max_tokens=32, ignore_eos=True))
        done = await wait_done(g.url, key, batch_id, timeout=120)
        out = await file_lines(g.url, key, done.output_file_id)
        records = _records(g.url, key)
    assert relay.killed and relay.completions == 2  # cut once, then answered on the retry
    assert done.status == "completed" and [o["response"]["status_code"] for o in out] == [200]
    # Old code: [error_midstream (the cut run's prompt), ok] under two request ids.
    assert [(r["status"], r["tier"]) for r in records] == [("ok", "batch")], records
    assert records[0]["request_id"] == out[0]["response"]["request_id"]
    assert records[0]["completion_tokens"] == 32
