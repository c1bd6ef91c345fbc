"""A process running the batch runner is SIGKILLed mid-batch; another one started on the same
store (as a restarted or second gateway would be) finishes the batch with exactly one output per
custom_id, and every result checkpointed before the kill is kept, not run again."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from tests.batch.conftest import chat_lines, client, jsonl
from tests.procs import Proc, free_port, running
from tests.wait import until


def batch_server(tmp: Path, node_url: str, model_dir: Path, worker: str) -> Proc:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "tests.batch.serve",
        "--port",
        str(port),
        "--data-dir",
        str(tmp),
        "--node-url",
        node_url,
        "--model-dir",
        str(model_dir),
        "--worker-id",
        worker,
        "--concurrency",
        "2",
        "--lease-s",
        "2",
        "--poll-s",
        "0.05",
    ]
    return Proc(args, port, tmp / f"batch-{worker}.log")


def finished_rows(db: Path, batch_id: str) -> dict[str, tuple[str, str]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT custom_id, request_id, response FROM batch_requests WHERE "
            "batch_id=? AND state='succeeded'",
            (batch_id,),
        ).fetchall()
    return {c: (rid, resp) for c, rid, resp in rows}


async def test_sigkill_mid_batch_then_resume(
    node: Proc, model_name: str, tiny_llama: Path, tmp_path: Path
) -> None:
    lines = chat_lines(50, model_name, max_tokens=128, ignore_eos=True)
    first = batch_server(tmp_path, node.url, tiny_llama, "gw-first")
    with running(first):
        async with client(first.url) as c:
            f = await c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            b = await c.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )

            async def some_done() -> bool:
                return (await c.batches.retrieve(b.id)).request_counts.completed >= 3

            await until(some_done, what="3 requests done")
            first.kill()  # SIGKILL: no shutdown code runs, claims stay in the store
    before = finished_rows(tmp_path / "batch.sqlite3", b.id)
    assert 3 <= len(before) < 50, "the batch must be cut mid-way for this test to mean anything"
    # Another worker id: it must wait for the dead one's leases to lapse, then take them over.
    second = batch_server(tmp_path, node.url, tiny_llama, "gw-second")
    with running(second):
        async with client(second.url) as c:

            async def completed() -> bool:
                return (await c.batches.retrieve(b.id)).status == "completed"

            await until(completed, timeout=120, what="batch completed after restart")
            b = await c.batches.retrieve(b.id)
            out = [
                json.loads(x)
                for x in (await (await c.files.content(b.output_file_id)).aread()).splitlines()
            ]
    assert b.request_counts.completed == 50 and b.error_file_id is None
    assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]  # one each, in order
    by_id = {o["custom_id"]: o for o in out}
    for custom_id, (rid, resp) in before.items():  # checkpointed results survived unchanged
        assert by_id[custom_id]["response"]["request_id"] == rid
        assert by_id[custom_id]["response"]["body"] == json.loads(resp)
    assert finished_rows(tmp_path / "batch.sqlite3", b.id) == {}  # ended: its lines left the store
