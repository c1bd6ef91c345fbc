"""One batch upload cannot take the gateway's memory, uploads are bounded in number, and a
batch's copies of its request bodies count in its team's storage and go when it ends.

- A valid 32 MiB input file whose bodies carry small nested arrays (`"x": [[], [], …]`): the
  old validation decoded every line and kept them all (about 21 bytes of Python objects per
  byte of file: the gateway's peak RSS grew ~700 MiB for this file), and creating the batch
  decoded the file again. Now both stream a line at a time: the peak grows by a few MiB.
- More uploads at once than `[batch] max_team_uploads` (per team) or `max_uploads` (the
  gateway) → 429 `too_many_uploads`, in OpenAI's error shape, at once; the held ones finish.
- A batch holds a copy of each request body in the store: they count in the team's
  `max_team_bytes` while it runs (413 `team_storage_full` past it), and are deleted when it
  ends (here: create → cancel, the loop that filled the disk for free before).

Real parts: a `duet gateway` process (batch runner idle, `concurrency = 0`: batches stay open
until cancelled), the official openai client, a raw socket for an upload held half sent, the
gateway's peak RSS from /proc (VmHWM, reset through clear_refs), its batch.sqlite3 read as it is.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.batch.gateway_procs import jsonl, lines_for
from tests.gateway.helpers import MODEL, gateway_proc, make_team, tiny_model
from tests.procs import Proc, running
from tests.wait import until, wait_for

MIB = 1 << 20
FILE_MIB = 32
TEAM_BYTES = 80 * MIB


@pytest.fixture(scope="module")
def gw(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("batch-memory")
    batch = {
        "data_dir": str(tmp / "batch"),
        "concurrency": 0,
        "poll_s": 0.05,
        "max_team_bytes": TEAM_BYTES,
        "max_uploads": 2,
        "max_team_uploads": 1,
    }
    g = gateway_proc(tmp, {MODEL: tiny_model(tiny_llama, both=["http://127.0.0.1:9"])}, batch=batch)
    g.batch_db = tmp / "batch" / "batch.sqlite3"  # type: ignore[attr-defined]
    with running(g):
        yield g


@pytest.fixture
async def client(gw: Proc, request: pytest.FixtureRequest) -> AsyncIterator[openai.AsyncOpenAI]:
    key = make_team(gw.url, request.node.name[:40])
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120
    ) as c:
        yield c


def nested_file(mib: int) -> bytes:
    """`mib` lines of just under 1 MiB (the line bound), each a valid chat request whose body
    carries an array of empty arrays: the shape that costs most when decoded."""
    out = []
    for i, line in enumerate(lines_for(mib)):
        head = json.dumps({**line, "custom_id": f"n{i}"})[:-2]  # open the body again
        out.append(head + ', "x": [' + "[]," * ((MIB - 2000) // 3) + "[]]}}")
    return ("\n".join(out) + "\n").encode()


def vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def reset_peak(pid: int) -> int:
    """Reset the process's peak RSS to its current RSS (Linux: clear_refs 5); the RSS now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return vm(pid, "VmRSS")


def peak_growth(pid: int, before: int) -> int:
    return vm(pid, "VmHWM") - before


async def test_an_upload_and_its_batch_take_a_bounded_memory(
    gw: Proc, client: openai.AsyncOpenAI
) -> None:
    data = nested_file(FILE_MIB)
    pid = gw.proc.pid
    before = reset_peak(pid)
    f = await client.files.create(file=("nested.jsonl", data), purpose="batch")
    upload = peak_growth(pid, before)
    before = reset_peak(pid)
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    create = peak_growth(pid, before)
    print(
        f"file {len(data) / MIB:.1f} MiB: peak RSS +{upload / MIB:.1f} MiB uploading, "
        f"+{create / MIB:.1f} MiB creating the batch"
    )
    assert b.status == "in_progress" and b.request_counts.total == FILE_MIB
    # The old code: +~700 MiB (21x the file) at the upload, as much again at the batch.
    assert upload < 3 * len(data), f"upload grew the peak RSS by {upload / MIB:.0f} MiB"
    assert create < 3 * len(data), f"creating grew the peak RSS by {create / MIB:.0f} MiB"
    await client.batches.cancel(b.id)


async def test_bodies_count_while_held_and_go_when_the_batch_ends(
    gw: Proc, client: openai.AsyncOpenAI
) -> None:
    data = nested_file(FILE_MIB)
    f = await client.files.create(file=("a.jsonl", data), purpose="batch")
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    held = _body_bytes(gw, b.id)
    assert held > (FILE_MIB - 1) * MIB, held  # the copies, ~the file's size
    # File + copies + this file would pass the team's bytes: refused while the batch runs.
    assert 2 * len(data) <= TEAM_BYTES < 3 * len(data)
    with pytest.raises(openai.APIStatusError) as e:
        await client.files.create(file=("b.jsonl", data), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "team_storage_full", e.value.body
    await client.batches.cancel(b.id)
    wait_for(lambda: _status(gw, b.id) == "cancelled", 60, "the cancelled batch to end")
    assert _body_bytes(gw, b.id) == 0  # the copies are gone with the batch
    second = await client.files.create(file=("b.jsonl", data), purpose="batch")
    assert second.bytes == len(data)  # and no longer hold the team's storage


def _db(gw: Proc) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{gw.batch_db}?mode=ro", uri=True)  # type: ignore[attr-defined]


def _body_bytes(gw: Proc, batch_id: str) -> int:
    with _db(gw) as db:
        (n,) = db.execute(
            "SELECT COALESCE(SUM(length(body)), 0) FROM batch_requests WHERE batch_id=?",
            (batch_id,),
        ).fetchone()
    return int(n)


def _status(gw: Proc, batch_id: str) -> str:
    with _db(gw) as db:
        return db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()[0]


class HeldUpload:
    """An upload whose request is sent up to half its file, then held: the gateway is reading
    it (its slot taken) until `finish`."""

    def __init__(self, gw: Proc, key: str) -> None:
        self.gw, self.key = gw, key
        boundary = uuid.uuid4().hex
        self.body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                'filename="held.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
            ).encode()
            + jsonl(lines_for(2))
            + f"\r\n--{boundary}--\r\n".encode()
        )
        self.headers = (
            f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(self.body)}\r\nConnection: close\r\n\r\n"
        ).encode()

    async def start(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.gw.port)
        self.writer.write(self.headers + self.body[: len(self.body) // 2])
        await self.writer.drain()

    async def finish(self) -> str:
        self.writer.write(self.body[len(self.body) // 2 :])
        await self.writer.drain()
        answer = await asyncio.wait_for(self.reader.read(), 60)
        self.writer.close()
        return answer.split(b"\r\n", 1)[0].decode()


async def _probe(gw: Proc, key: str) -> tuple[int, dict]:
    """An upload refused at once whatever happens (no file): 429 while the team's or the
    gateway's upload slots are taken, 400 otherwise; it never stores anything."""
    form = aiohttp.FormData(default_to_multipart=True)
    form.add_field("purpose", "batch")
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/files", data=form, headers=headers) as r,
    ):
        return r.status, (await r.json())["error"]


async def _refused_while_held(gw: Proc, key: str) -> dict:
    async def refused() -> dict | None:
        status, body = await _probe(gw, key)
        return body if status == 429 else None

    return await until(refused, 30, "the held upload to take its slot")


async def test_more_uploads_than_allowed_are_refused(gw: Proc) -> None:
    a, b, c = (make_team(gw.url, f"uploads-{x}") for x in "abc")
    held_a, held_b = HeldUpload(gw, a), HeldUpload(gw, b)
    await held_a.start()
    err = await _refused_while_held(gw, a)  # team a's one slot is taken
    assert err["code"] == "too_many_uploads" and err["type"] == "rate_limit_error", err
    assert "team" in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert (await _probe(gw, b))[0] == 400  # another team still uploads
    await held_b.start()
    err = await _refused_while_held(gw, c)  # the gateway's two slots are taken
    assert err["code"] == "too_many_uploads" and "gateway" in err["message"], err
    assert (await held_a.finish()).endswith("200 OK")
    assert (await held_b.finish()).endswith("200 OK")
    assert (await _probe(gw, c))[0] == 400 and (await _probe(gw, a))[0] == 400  # slots back
