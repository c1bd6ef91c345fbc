"""Faults under a running batch, with real processes: the gateway is SIGKILLed mid-batch and
restarted on the same store (the batch completes, exactly one output per custom_id, results
checkpointed before the kill kept as they were), and one of two nodes behind the gateway is
SIGKILLed mid-batch (the batch still completes, every line answered 200)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from tests.batch.conftest import client
from tests.batch.gateway_procs import (
    NODE_ARGS,
    batch_gateway,
    completed_at_least,
    file_lines,
    lines_for,
    submit,
    usage_records,
    wait_done,
)
from tests.gateway.helpers import make_team
from tests.procs import duet_node, running
from tests.wait import until


def succeeded(db: Path, batch_id: str) -> dict[str, tuple[str, str]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT custom_id, request_id, response FROM batch_requests WHERE batch_id=? "
            "AND state='succeeded'",
            (batch_id,),
        ).fetchall()
    return {c: (rid, resp) for c, rid, resp in rows}


async def test_gateway_sigkill_mid_batch_then_restart(tiny_llama: Path, tmp_path: Path) -> None:
    node = duet_node("both", tiny_llama, tmp_path, *NODE_ARGS)
    lines = lines_for(40, max_tokens=48, ignore_eos=True)
    first = batch_gateway(tmp_path, tiny_llama, [node.url], concurrency=2)
    with running(node, first):
        key = make_team(first.url, "team-a")
        async with client(first.url, key) as c:
            batch_id = await submit(c, lines)
        await completed_at_least(first.url, key, batch_id, 3)
        first.kill()  # SIGKILL: claims stay in the store, in-flight lines die with it
        before = succeeded(tmp_path / "batch" / "batch.sqlite3", batch_id)
        assert 3 <= len(before) < 40, "the batch must be cut mid-way for this test to mean anything"
        # Same port, same store: the same worker id, so it takes its old claims back at once.
        second = batch_gateway(tmp_path, tiny_llama, [node.url], port=first.port, concurrency=2)
        with running(second):
            b = await wait_done(second.url, key, batch_id, timeout=180)
            out = await file_lines(second.url, key, b.output_file_id)
    assert b.status == "completed" and b.request_counts.completed == 40 and b.error_file_id is None
    assert [o["custom_id"] for o in out] == [
        x["custom_id"] for x in lines
    ]  # exactly one each, in order
    assert all(o["response"]["status_code"] == 200 for o in out)
    by_id = {o["custom_id"]: o["response"] for o in out}
    for custom_id, (rid, resp) in before.items():  # checkpointed results were not run again
        assert (by_id[custom_id]["request_id"], by_id[custom_id]["body"]) == (rid, json.loads(resp))
    assert succeeded(tmp_path / "batch" / "batch.sqlite3", batch_id) == {}  # ended: lines gone
    # every output line was served, and accounted, by a gateway at the batch tier
    ok = {
        r["request_id"]: r
        for r in usage_records(tmp_path / "gateway.db", "team-a")
        if r["status"] == "ok"
    }
    for o in out:
        r = ok[o["response"]["request_id"]]
        assert r["tier"] == "batch" and r["completion_tokens"] == 48


async def test_node_sigkill_mid_batch(tiny_llama: Path, tmp_path: Path) -> None:
    a, b = (
        duet_node("both", tiny_llama, tmp_path, *NODE_ARGS),
        duet_node("both", tiny_llama, tmp_path, *NODE_ARGS),
    )
    lines = lines_for(80, max_tokens=48, ignore_eos=True)
    gw = batch_gateway(tmp_path, tiny_llama, [a.url, b.url], concurrency=4)
    with running(a, b, gw):
        key = make_team(gw.url, "team-a")
        async with client(gw.url, key) as c:
            batch_id = await submit(c, lines)

        # The victim is a node that has served lines: with a fast CPU and a tiny model the
        # least-loaded router may give every early line to one node (in flight rarely reaches 2),
        # and waiting for both to serve let the whole batch finish before the kill.
        # (read from the store directly: `duet usage report` starts a process, a second or two in
        # which the whole batch can end)
        def served_nodes() -> set[str]:
            with sqlite3.connect(f"file:{tmp_path / 'gateway.db'}?mode=ro", uri=True) as conn:
                rows = conn.execute("SELECT nodes FROM usage").fetchall()
            return {n for (nodes,) in rows for n in json.loads(nodes)}

        await until(lambda: bool(served_nodes()), 60, "a usage record of a served line")
        served = served_nodes()
        victim = b if b.url in served else a
        killed_at = time.time()
        victim.kill()
        done = await wait_done(gw.url, key, batch_id, timeout=180)
        out = await file_lines(gw.url, key, done.output_file_id)
    # usage records (same host clock) tell what was served before the kill, and by which nodes
    before = [
        r for r in usage_records(tmp_path / "gateway.db", "team-a") if r["created_at"] < killed_at
    ]
    served_before = {
        n for r in before for n in r["nodes"].split()
    }  # the report joins node lists with " "
    assert victim.url in served_before, (
        f"the killed node must have served lines before the kill: {served_before}"
    )
    assert len(before) < 80, "the kill must come mid-batch"
    assert (
        done.status == "completed"
        and done.request_counts.completed == 80
        and done.error_file_id is None
    )
    assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 48 for o in out)
