"""The gateway's files are not readable by other users of the host: its store, the
batch store and every uploaded batch file are created 0600 in 0700 directories, whatever the
process umask (they were 0644 in 0755 directories under the usual umask), and an upload is
fsynced before it is answered.

Real parts: a gateway process with the batch tier, the official openai client uploading a
file; the modes are read off the disk.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import openai
import pytest

from tests.batch.gateway_procs import jsonl, lines_for
from tests.gateway.helpers import MODEL, gateway_proc, make_team, tiny_model
from tests.procs import running


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


async def test_stores_and_uploads_are_private(tiny_llama: Path, tmp_path: Path) -> None:
    old = os.umask(0o022)  # the usual umask: what a file gets without the gateway's care
    try:
        store = tmp_path / "state" / "gateway.db"
        data = tmp_path / "batch-data"
        gw = gateway_proc(
            tmp_path,
            {MODEL: tiny_model(tiny_llama, both=["http://127.0.0.1:9"])},
            store=store,
            batch={"data_dir": str(data)},
        )
    finally:
        os.umask(old)
    with running(gw):
        key = make_team(gw.url, "private")
        c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)
        f = await c.files.create(file=("input.jsonl", jsonl(lines_for(2))), purpose="batch")
        assert f.id
    assert _mode(store.parent) == 0o700 and _mode(store) == 0o600
    assert _mode(data) == 0o700
    files = [p for p in data.rglob("*") if p.is_file()]
    assert files, "no batch file on disk"
    bad = {str(p.relative_to(tmp_path)): oct(_mode(p)) for p in files if _mode(p) & 0o077}
    assert not bad, f"readable by others: {bad}"
    for p in store.parent.iterdir():  # the WAL and shared-memory files too
        assert _mode(p) & 0o077 == 0, (p, oct(_mode(p)))


def test_written_and_replaced_files_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch file (an output, a result file rewritten) is fsynced before it is renamed into
    place, and the directory after the rename, so neither its bytes nor its name are lost to a
    crash. A crash cannot be staged here: os.fsync is observed (and still called) instead."""
    from gateway.batch.files import FileStore

    synced: list[str] = []
    real = os.fsync

    def observed(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    store = FileStore(tmp_path / "files")
    monkeypatch.setattr(os, "fsync", observed)
    for _ in range(2):  # the second write replaces the first file
        store.write("file-abc123", [b'{"a": 1}\n'])
        assert (
            len(synced) == 2 and synced[0].endswith(".tmp") and synced[1] == str(store.directory)
        ), synced
        synced.clear()
    assert store.path("file-abc123").read_bytes() == b'{"a": 1}\n'
