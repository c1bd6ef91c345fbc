"""A full disk under the gateway's store: new work is refused with 503 `store_unavailable` (a
clear message and a Retry-After) before any node computes for it, no usage record already
written is lost, and the gateway serves again once space returns — without a restart.

The store is SQLite on a small tmpfs mounted for the test (root only: skipped elsewhere, but
fails under CI=true), filled with a file as `duet bench chaos --faults disk` does; a real
decode node, a real gateway, the official openai client.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from runtime.strict import strict_mode
from tests.gateway.helpers import MODEL, gateway_proc, make_team, metric, tiny_model
from tests.gateway.test_failures import _node
from tests.procs import running


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs of the test's own."""
    why = None if os.geteuid() == 0 else "mounting a tmpfs needs root"
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if why is None:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)])
        why = None if r.returncode == 0 else f"mount -t tmpfs failed ({r.returncode})"
    if why is not None:
        if strict_mode():
            pytest.fail(f"{why}; under CI=true the full-disk test must run, not skip")
        pytest.skip(why)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def _fill(fs: Path) -> Path:
    """Every free byte of `fs` taken by one file."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 16, 1):  # large writes, then the last bytes one by one
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)
    return filler


def _rows(db: Path, team: str) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as c:
        return c.execute("SELECT count(*) FROM usage WHERE team_id = ?", (team,)).fetchone()[0]


async def test_full_disk_refuses_new_work_and_recovers(
    small_fs: Path, tmp_path: Path, tiny_llama: Path
) -> None:
    d = _node("decode", tiny_llama, tmp_path)
    db = small_fs / "gateway.db"
    g = gateway_proc(tmp_path, {MODEL: tiny_model(tiny_llama, decode=[d.url])}, store=db)
    with running(d, g):
        key = make_team(g.url, "s")
        c = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0, timeout=60)

        async def ask() -> None:
            await c.completions.create(model=MODEL, prompt="hello " * 20, max_tokens=8)

        for _ in range(3):
            await ask()
        before = _rows(db, "s")
        assert before == 3
        filler = _fill(small_fs)
        made = metric(d.url, "duet:generation_tokens_total")
        try:
            for _ in range(3):  # every one refused, each with the defined error
                with pytest.raises(openai.APIStatusError) as e:
                    await ask()
                assert e.value.status_code == 503, (e.value.status_code, e.value.message)
                assert e.value.body["code"] == "store_unavailable", e.value.body
                assert "full" in e.value.message
                assert int(e.value.response.headers["Retry-After"]) >= 1
            # refused before any node computed for them: no work that could not be billed
            assert metric(d.url, "duet:generation_tokens_total") == made
        finally:
            filler.unlink()
        await ask()  # space is back: served again, no restart
        assert _rows(db, "s") >= before + 1  # nothing written before the fault was lost
