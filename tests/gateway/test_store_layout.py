"""A deployment's data survives the one store: a gateway started on a data directory (or a
PostgreSQL database) written with the schema of the two stores it replaced — the accounts'
tables in `gateway.db`, the batch tier's in `batch/batch.sqlite3` (tests/fixtures/
old_store_layout/) — still serves that deployment's usage records, files and batch results.

Real parts: SQLite files written with the old SQL, the gateway app in this process answering
`/v1/usage`, `/v1/files/{id}/content` and `/v1/batches/{id}` through the official openai
client; a real PostgreSQL server (pgserver) for the shared-database layout.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import asyncpg
import openai
from aiohttp.test_utils import TestClient, TestServer

from gateway.accounts.keys import new_key
from gateway.accounts.store.postgres import PostgresStore
from gateway.app import make_app
from gateway.config import parse_config

OLD = Path(__file__).resolve().parents[1] / "fixtures" / "old_store_layout"
NOW = time.time()
BATCH_ROW = (  # id, team, kind, endpoint, input, window, status, total, output, created, expires
    "batch_old1",
    "t",
    "openai",
    "/v1/completions",
    "file-in1",
    "24h",
    "completed",
    1,
    "file-out1",
    NOW - 60,
    NOW + 86_400,
)
RESULT = {"status_code": 200, "request_id": "req-old", "body": {"choices": [{"text": "hi"}]}}


def _old_sqlite(tmp_path: Path) -> tuple[str, str]:
    """A data directory as the old gateway left it: a team, its key, one usage record, an input
    and an output file, and a completed batch whose one request has its result. Returns the key's
    secret and the output file's contents."""
    key, secret, digest = new_key("t")
    with sqlite3.connect(tmp_path / "gateway.db") as db:
        db.executescript((OLD / "sqlite_gateway.sql").read_text())
        db.execute(
            "INSERT INTO teams (id, default_tier, created_at) VALUES ('t', 'interactive', 1)"
        )
        db.execute(
            "INSERT INTO api_keys (id, team_id, name, prefix, secret_hash, created_at) "
            "VALUES (?, 't', '', '', ?, 1)",
            (key.id, digest),
        )
        db.execute(
            "INSERT INTO usage (request_id, team_id, key_id, model_requested, model_used, tier, "
            "status, endpoint, prompt_tokens, completion_tokens, cached_tokens, cost_usd, "
            "latency_s, nodes, created_at) VALUES ('req-old', 't', ?, 'tiny', 'tiny', 'batch', "
            "'ok', 'completion', 7, 3, 0, 0.5, 0.1, '[\"n1\"]', ?)",
            (key.id, NOW - 30),
        )
    batch = tmp_path / "batch"
    (batch / "files").mkdir(parents=True)
    out = json.dumps({"id": "batch_req_1", "custom_id": "c0", "response": RESULT}) + "\n"
    (batch / "files" / "file-out1.jsonl").write_text(out)
    with sqlite3.connect(batch / "batch.sqlite3") as db:
        db.executescript((OLD / "sqlite_batch.sql").read_text())
        for fid, purpose in (("file-in1", "batch"), ("file-out1", "batch_output")):
            db.execute(
                "INSERT INTO batch_files (id, team_id, purpose, filename, bytes, created_at) "
                "VALUES (?, 't', ?, ?, ?, ?)",
                (fid, purpose, f"{fid}.jsonl", len(out), NOW - 60),
            )
        db.execute(
            "INSERT INTO batches (id, team_id, kind, endpoint, input_file_id, completion_window, "
            "status, total, output_file_id, created_at, expires_at) VALUES "
            "(?,?,?,?,?,?,?,?,?,?,?)",
            BATCH_ROW,
        )
        db.execute(
            "INSERT INTO batch_requests (batch_id, custom_id, line, body, state, status_code, "
            "request_id, response) VALUES ('batch_old1', 'c0', 1, '{}', 'succeeded', 200, "
            "'req-old', ?)",
            (json.dumps(RESULT["body"]),),
        )
    return secret, out


async def test_a_gateway_on_an_old_sqlite_data_dir_serves_its_records(
    tiny_llama: Path, tmp_path: Path
) -> None:
    secret, out = _old_sqlite(tmp_path)
    cfg = parse_config(
        {
            "store": {"url": f"sqlite://{tmp_path / 'gateway.db'}"},
            "models": {
                "tiny": {"tokenizer": str(tiny_llama), "static": {"both": ["http://127.0.0.1:9"]}}
            },
        }
    )
    async with TestClient(TestServer(make_app(cfg))) as client:
        oai = openai.AsyncOpenAI(
            base_url=str(client.make_url("/v1")), api_key=secret, max_retries=0
        )
        r = await client.get(
            "/v1/usage",
            params={"start": str(int(NOW - 3600)), "end": str(int(NOW + 60)), "group_by": "record"},
            headers={"Authorization": f"Bearer {secret}"},
        )
        assert r.status == 200, await r.text()
        [record] = (await r.json())["data"]
        assert (record["request_id"], record["prompt_tokens"], record["cost_usd"]) == (
            "req-old",
            7,
            0.5,
        )
        b = await oai.batches.retrieve("batch_old1")
        assert (b.status, b.output_file_id) == ("completed", "file-out1")
        content = await oai.files.content("file-out1")
        assert content.text == out
        assert (await oai.files.retrieve("file-in1")).purpose == "batch"


async def test_the_one_store_reads_an_old_postgres_database(postgres_db: str) -> None:
    con = await asyncpg.connect(postgres_db)
    try:
        await con.execute((OLD / "postgres.sql").read_text())
        await con.execute(
            "INSERT INTO usage (request_id, team_id, key_id, model_requested, model_used, tier, "
            "status, endpoint, prompt_tokens, completion_tokens, cached_tokens, cost_usd, "
            "latency_s, nodes, created_at) VALUES ('req-old', 't', 'k', 'tiny', 'tiny', 'batch', "
            "'ok', 'completion', 7, 3, 0, 0.5, 0.1, '[\"n1\"]', $1)",
            NOW - 30,
        )
        await con.execute(
            "INSERT INTO batch_files (id, team_id, purpose, filename, bytes, created_at) "
            "VALUES ('file-out1', 't', 'batch_output', 'out.jsonl', 10, $1)",
            NOW - 60,
        )
        await con.execute(
            "INSERT INTO batches (id, team_id, kind, endpoint, input_file_id, completion_window, "
            "status, total, output_file_id, created_at, expires_at) VALUES "
            "($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11)",
            *BATCH_ROW,
        )
        await con.execute(
            "INSERT INTO batch_requests (batch_id, custom_id, line, body, state, status_code, "
            "request_id, response) VALUES ('batch_old1', 'c0', 1, '{}', 'succeeded', 200, "
            "'req-old', $1)",
            json.dumps(RESULT["body"]),
        )
    finally:
        await con.close()
    store = PostgresStore(postgres_db)
    await store.open()
    try:
        [record] = await store.usage_records("t", NOW - 3600, NOW + 60)
        assert (record.request_id, record.prompt_tokens, record.nodes) == ("req-old", 7, ["n1"])
        f = await store.get_file("t", "file-out1")
        assert f is not None and f.purpose == "batch_output"
        batch = await store.get_batch("t", "batch_old1")
        assert batch is not None and batch.output_file_id == "file-out1"
        # its count came from its line, which then left the store (its result is its file's)
        assert batch.counts.completed == 1 and await store.results("batch_old1") == []
    finally:
        await store.close()
