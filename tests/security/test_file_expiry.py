"""Batch files expire, with OpenAI's `expires_after`: an expired file is gone for
the API (get, list, content) and no longer counts against its team's storage
(`[batch] max_team_bytes`). Before, a file never expired and its upload's `expires_after`
fields were ignored.

Real parts: the batch store on SQLite and on a real PostgreSQL server; a `duet gateway` process
and the official openai client for the upload fields.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.rows import FileRow
from tests.batch.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.batch.gateway_procs import jsonl, lines_for
from tests.batch.test_store import open_store  # noqa: F401  (the store on both backends)
from tests.gateway.helpers import MODEL, gateway_proc, make_team, tiny_model
from tests.procs import running


def _file(id_: str, expires_at: float | None) -> FileRow:
    return FileRow(
        id=id_,
        team_id="t",
        purpose="batch",
        filename="x.jsonl",
        bytes=1000,
        created_at=1.0,
        expires_at=expires_at,
    )


async def test_an_expired_file_is_gone_and_frees_its_storage(
    tmp_path: Path,
    open_store: Any,  # noqa: F811
) -> None:
    s = open_store(tmp_path / "db.sqlite3")
    try:
        now = time.time()
        await s.insert_file(_file("file-old", now - 1))
        await s.insert_file(_file("file-live", now + 3600))
        await s.insert_file(_file("file-forever", None))
        assert await s.get_file("t", "file-old") is None
        assert (await s.get_file("t", "file-live")).expires_at == pytest.approx(now + 3600)
        rows, _ = await s.list_files("t", None, None, 10)
        assert {r.id for r in rows} == {"file-live", "file-forever"}
        assert (await s.team_holdings("t"))[0] == 2000
    finally:
        s.close()


async def test_expired_files_leave_the_disk(tmp_path: Path, open_store: Any) -> None:  # noqa: F811
    """An expired file stopped counting in its team's storage while its bytes stayed on disk, so
    a team uploading with `expires_after` could fill the disk past `max_team_bytes` forever. The
    runner's sweep marks expired files deleted in the store and removes their contents; live
    and never-expiring files stay. Two gateways' sweeps never take one file twice."""
    from gateway.batch.config import BatchConfig
    from gateway.batch.runner import BatchRunner

    s, other = open_store(tmp_path / "db.sqlite3"), open_store(tmp_path / "db.sqlite3")
    runner = BatchRunner(s, executor=None, config=BatchConfig(data_dir=tmp_path))  # type: ignore[arg-type]
    try:
        now = time.time()
        for fid, expires in (
            ("file-old", now - 1),
            ("file-older", now - 60),
            ("file-live", now + 3600),
            ("file-forever", None),
        ):
            runner.files.write(fid, [b'{"x": 1}\n'])
            await s.insert_file(_file(fid, expires))
        assert await runner.sweep_expired_files(now) == 2
        assert {
            f
            for f in ("file-old", "file-older", "file-live", "file-forever")
            if runner.files.path(f).exists()
        } == {"file-live", "file-forever"}
        assert await runner.sweep_expired_files(now) == 0
        assert await other.purge_expired_files(now) == []  # the other gateway finds nothing left
        assert (await s.team_holdings("t"))[0] == 2000
    finally:
        s.close()
        other.close()


async def test_a_store_made_before_expiry_opens(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:  # batch_files as it was, without expires_at
        db.execute(
            "CREATE TABLE batch_files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL "
            "UNIQUE, team_id TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes "
            "INTEGER NOT NULL, created_at REAL NOT NULL, deleted INTEGER NOT NULL DEFAULT 0)"
        )
        db.execute(
            "INSERT INTO batch_files (id, team_id, purpose, filename, bytes, created_at) "
            "VALUES ('file-a', 't', 'batch', 'a.jsonl', 5, 1.0)"
        )
    s = SqliteBatchStore(path)
    try:
        assert (await s.get_file("t", "file-a")).expires_at is None
        await s.insert_file(_file("file-b", time.time() - 1))
        assert await s.get_file("t", "file-b") is None
    finally:
        s.close()


async def test_upload_honours_expires_after(tiny_llama: Path, tmp_path: Path) -> None:
    gw = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama, both=["http://127.0.0.1:9"])},
        batch={"data_dir": str(tmp_path / "batch"), "concurrency": 0},
    )
    with running(gw):
        key = make_team(gw.url, "expiring")
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30
        ) as c:
            f = await c.files.create(
                file=("in.jsonl", jsonl(lines_for(1))),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": 3600},
            )
            assert f.expires_at is not None and abs(f.expires_at - (f.created_at + 3600)) <= 1, f
            assert (await c.files.retrieve(f.id)).expires_at == f.expires_at
            assert (
                await c.files.create(file=("in.jsonl", jsonl(lines_for(1))), purpose="batch")
            ).expires_at is None
            for bad in (
                {"anchor": "created_at", "seconds": 60},
                {"anchor": "last_active_at", "seconds": 3600},
            ):
                with pytest.raises(openai.BadRequestError) as e:
                    await c.files.create(
                        file=("in.jsonl", jsonl(lines_for(1))), purpose="batch", expires_after=bad
                    )  # type: ignore[arg-type]
                assert e.value.body["param"] == "expires_after", e.value.body
