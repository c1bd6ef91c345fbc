"""Two gateways share one PostgreSQL store (a real server from pgserver) and one batch data
directory: a batch uploaded through one is visible through the other, both run its lines, and
when the first is SIGKILLed mid-batch the second takes over its lapsed claims and finishes it,
with exactly one output per custom_id."""

from __future__ import annotations

from pathlib import Path

from tests.batch.conftest import client
from tests.batch.gateway_procs import (
    NODE_ARGS,
    batch_gateway,
    completed_at_least,
    file_lines,
    lines_for,
    submit,
    wait_done,
)
from tests.gateway.helpers import make_team
from tests.procs import duet_node, running


async def test_two_gateways_share_batches_through_postgres(
    tiny_llama: Path, tmp_path: Path, postgres_db: str
) -> None:
    node = duet_node("both", tiny_llama, tmp_path, *NODE_ARGS)
    shared = {"store": postgres_db, "data_dir": str(tmp_path / "shared-batch"), "concurrency": 2}
    g1 = batch_gateway(tmp_path, tiny_llama, [node.url], **shared)
    g2 = batch_gateway(tmp_path, tiny_llama, [node.url], **shared)
    lines = lines_for(40, max_tokens=32, ignore_eos=True)
    with running(node, g1, g2):
        key = make_team(g1.url, "team-a")  # one store: the key works on both
        async with client(g1.url, key) as c:
            batch_id = await submit(c, lines)
        await completed_at_least(g2.url, key, batch_id, 6)
        g1.kill()
        b = await wait_done(g2.url, key, batch_id, timeout=180)
        out = await file_lines(g2.url, key, b.output_file_id)
        logs = g1.log(), g2.log()
    assert b.status == "completed" and b.request_counts.completed == 40 and b.error_file_id is None
    assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]
    assert all(o["response"]["status_code"] == 200 for o in out)
    for log in logs:  # both gateways' runners took lines
        assert "tier=batch status=ok" in log
