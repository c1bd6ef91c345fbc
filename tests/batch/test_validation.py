"""The batch API's refusals, without running requests: malformed files (by line number), limits,
bad batch bodies, another team's objects (404), pagination, and callback URL checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.batch.callback import (
    CallbackSender,
    CallbackURLError,
    GuardedResolver,
    address_allowed,
    check_callback_url,
    sign,
    verify_signature,
)
from gateway.batch.config import BatchConfig
from tests.batch.app import make_app
from tests.batch.conftest import chat_lines, client, jsonl


def config(tmp_path: Path, **kw: object) -> BatchConfig:
    return BatchConfig(data_dir=tmp_path, models=frozenset({"m"}), callback_secret="s", **kw)  # type: ignore[arg-type]


async def test_malformed_file_refused_with_line_numbers(tmp_path: Path, serve) -> None:
    url = await serve(make_app(config(tmp_path)))
    good = chat_lines(2, "m")
    lines = [
        json.dumps(good[0]).encode(),  # 1 ok
        b'{"custom_id": "x", "method": "POST", ',  # 2 malformed JSON
        json.dumps(good[0]).encode(),  # 3 duplicate custom_id
        json.dumps({**good[1], "method": "GET"}).encode(),  # 4 wrong method
        b"",  # 5 blank: skipped
        json.dumps({**good[1], "custom_id": "u", "url": "/v1/embeddings"}).encode(),  # 6
        json.dumps({**good[1], "custom_id": "v", "body": {"messages": []}}).encode(),  # 7
        b"[1, 2]",  # 8 not an object
    ]
    async with client(url) as c:
        with pytest.raises(openai.BadRequestError) as e:
            await c.files.create(file=("bad.jsonl", b"\n".join(lines)), purpose="batch")
        msg = e.value.message
        by_line = dict(re.findall(r"line (\d+): ([^;]*)", msg))
        assert sorted(map(int, by_line)) == [2, 3, 4, 6, 7, 8], msg
        for n, what in (
            (2, "malformed JSON"),
            (3, "already used on line 1"),
            (4, "POST"),
            (6, "/v1/embeddings"),
            (7, "body.model"),
            (8, "Expected `object`"),
        ):
            assert what in by_line[str(n)], (n, msg)
        assert e.value.body["param"] == "file"  # type: ignore[index]
        # Nothing was stored.
        assert (await c.files.list()).data == []
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await c.files.create(file=("ok.jsonl", jsonl(good)), purpose="assistants")
        with pytest.raises(openai.BadRequestError, match="no requests"):
            await c.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")


async def test_file_limits(tmp_path: Path, serve) -> None:
    url = await serve(make_app(config(tmp_path, max_requests=3, max_file_bytes=2000)))
    async with client(url) as c:
        with pytest.raises(openai.BadRequestError, match="line 4: a batch holds at most 3"):
            await c.files.create(file=("four.jsonl", jsonl(chat_lines(4, "m"))), purpose="batch")
        with pytest.raises(openai.APIStatusError) as e:
            await c.files.create(
                file=("big.jsonl", jsonl(chat_lines(3, "m")) + b" " * 2000), purpose="batch"
            )
        assert e.value.status_code == 413
        f = await c.files.create(
            file=('ok"\r\nX: 1.jsonl', jsonl(chat_lines(3, "m"))), purpose="batch"
        )
        assert re.fullmatch(r"ok[\w\- ]+1\.jsonl", f.filename), (
            f.filename
        )  # no quote, CR or LF left
        assert f.bytes == len(jsonl(chat_lines(3, "m"))) and f.purpose == "batch"
        assert await (await c.files.content(f.id)).aread() == jsonl(chat_lines(3, "m"))
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as s:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        for name in ("a.jsonl", "b.jsonl"):
            form.add_field("file", jsonl(chat_lines(1, "m")), filename=name)
        async with s.post(url + "/v1/files", data=form) as r:
            assert r.status == 400 and "one file" in (await r.json())["error"]["message"]
        async with s.post(url + "/v1/files", json={"purpose": "batch"}) as r:
            assert r.status == 400 and "multipart" in (await r.json())["error"]["message"]
        nested = aiohttp.MultipartWriter("form-data")
        inner = aiohttp.MultipartWriter("mixed")
        inner.append(jsonl(chat_lines(1, "m")))
        nested.append(inner)
        async with s.post(url + "/v1/files", data=nested) as r:
            assert r.status == 400 and "multipart" in (await r.json())["error"]["message"]
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [
        f"{f.id}.jsonl"
    ]  # no temp left


async def test_batch_lines_unfit_for_the_batch_fail_it_with_line_numbers(
    tmp_path: Path, serve
) -> None:
    url = await serve(make_app(config(tmp_path)))
    lines = chat_lines(3, "m")
    lines[1]["body"]["model"] = "not-served"
    lines[2]["url"] = "/v1/completions"
    lines[2]["body"] = {"model": "m", "prompt": "hi"}
    async with client(url) as c:
        f = await c.files.create(file=("f.jsonl", jsonl(lines)), purpose="batch")
        b = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert b.status == "failed" and b.failed_at is not None
        assert b.errors is not None
        assert [(e.line, e.code) for e in b.errors.data] == [
            (2, "model_not_found"),
            (3, "mismatched_endpoint"),
        ]
        assert b.request_counts is not None and b.request_counts.total == 0


async def test_bad_batch_bodies(tmp_path: Path, serve) -> None:
    url = await serve(make_app(config(tmp_path)))
    async with client(url) as c:
        f = await c.files.create(file=("f.jsonl", jsonl(chat_lines(2, "m"))), purpose="batch")
        for kwargs, match in (
            ({"completion_window": "1h"}, "completion_window"),
            ({"endpoint": "/v1/embeddings"}, "endpoint"),
            ({"metadata": {f"k{i}": "v" for i in range(17)}}, "16 pairs"),
        ):
            args = {
                "input_file_id": f.id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                **kwargs,
            }
            with pytest.raises(openai.BadRequestError, match=match):
                await c.batches.create(**args)  # type: ignore[arg-type]
        with pytest.raises(openai.NotFoundError):
            await c.batches.create(
                input_file_id="file-missing",
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as s:
        for raw in (
            b"{",
            b'{"input_file_id": 1}',
            b'{"input_file_id": "x", "endpoint": "e", "completion_window": "24h", "surprise": 1}',
        ):
            async with s.post(url + "/v1/batches", data=raw) as r:
                body = await r.json()
                assert r.status == 400 and set(body["error"]) == {
                    "message",
                    "type",
                    "param",
                    "code",
                }
        async with s.get(url + "/v1/batches?limit=0") as r:
            assert r.status == 400
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/batches") as r:
        assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"


async def test_another_team_gets_404(tmp_path: Path, serve) -> None:
    url = await serve(make_app(config(tmp_path)))
    async with client(url, "key-a") as a, client(url, "key-b") as b:
        f = await a.files.create(file=("f.jsonl", jsonl(chat_lines(2, "m"))), purpose="batch")
        batch = await a.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        for call in (
            lambda: b.files.retrieve(f.id),
            lambda: b.files.content(f.id),
            lambda: b.files.delete(f.id),
            lambda: b.batches.retrieve(batch.id),
            lambda: b.batches.cancel(batch.id),
            lambda: b.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                await call()
        assert (await b.batches.list()).data == [] and (await b.files.list()).data == []
        # The owner still sees both, unchanged.
        assert (await a.batches.retrieve(batch.id)).status == "in_progress"
        assert (await a.files.retrieve(f.id)).id == f.id
        cancelled = await a.batches.cancel(batch.id)
        assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
        assert (await a.files.delete(f.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await a.files.retrieve(f.id)


async def test_list_batches_paginates_newest_first(tmp_path: Path, serve) -> None:
    url = await serve(make_app(config(tmp_path)))
    async with client(url) as c:
        f = await c.files.create(file=("f.jsonl", jsonl(chat_lines(1, "m"))), purpose="batch")
        ids = [
            (
                await c.batches.create(
                    input_file_id=f.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                    metadata={"i": str(i)},
                )
            ).id
            for i in range(5)
        ]
        page = await c.batches.list(limit=2)
        assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
        seen = [b.id async for b in c.batches.list(limit=2)]  # the SDK follows `after`
        assert seen == ids[::-1]
        assert (await c.batches.retrieve(ids[0])).metadata == {"i": "0"}


async def test_simple_form_refusals(tmp_path: Path, serve) -> None:
    url = await serve(make_app(config(tmp_path, max_priority=2)))  # "high" is granted here
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as s:

        async def post(body: dict) -> tuple[int, dict]:
            async with s.post(url + "/v1/batch", json=body) as r:
                return r.status, await r.json()

        status, body = await post({"requests": [ok, {"model": "m"}, {**ok, "model": "other"}, 5]})
        assert status == 400
        msg = body["error"]["message"]
        assert "line 2: body.messages" in msg and "line 4: a request must be an object" in msg
        assert "line 3: model 'other' is not served" in msg and "line 1:" not in msg
        status, body = await post({"requests": [ok, {"custom_id": "request-1", "body": ok}]})
        assert (
            status == 400
            and "line 2" in body["error"]["message"]
            and "already used" in body["error"]["message"]
        )
        for cb in (
            "ftp://example.com/x",
            "http://127.0.0.1:9/cb",
            "http://localhost:9/cb",
            "http://user:pw@example.com/",
            "http://[::1]/",
            "not a url",
        ):
            status, body = await post({"requests": [ok], "callback_url": cb})
            assert status == 400 and body["error"]["param"] == "callback_url", (cb, body)
        huge = {"model": "m", "messages": [{"role": "user", "content": "x" * 2_000_000}]}
        status, err = await post({"requests": [huge]})  # over the app's client_max_size
        assert status == 413 and set(err["error"]) == {"message", "type", "param", "code"}
        status, body = await post({"requests": [ok], "priority": "urgent"})
        assert status == 400
        status, body = await post({"requests": [ok], "priority": "high"})
        assert (
            status == 202
            and body["batch_id"].startswith("batch_")
            and body["estimated_completion"] > 0
        )
        async with s.get(url + f"/v1/batch/{body['batch_id']}") as r:
            got = await r.json()
            assert got["status"] == "in_progress" and got["request_counts"]["total"] == 1
    async with (
        aiohttp.ClientSession(headers={"Authorization": "Bearer key-b"}) as s,
        s.get(url + f"/v1/batch/{body['batch_id']}") as r,
    ):
        assert r.status == 404


async def test_callback_address_checks() -> None:
    for addr, public in (
        ("8.8.8.8", True),
        ("10.1.2.3", False),
        ("192.168.0.1", False),
        ("127.0.0.1", False),
        ("169.254.169.254", False),
        ("::1", False),
        ("fd00::1", False),
        ("::ffff:10.0.0.1", False),
        ("0.0.0.0", False),
        ("2606:4700::1111", True),
        ("100.64.0.1", False),
    ):
        assert address_allowed(addr, allow_private=False) is public, addr
    assert address_allowed("127.0.0.1", allow_private=True)
    assert not address_allowed("0.0.0.0", allow_private=True)  # never "any address"
    await check_callback_url("http://127.0.0.1:8080/cb", allow_private=True)
    with pytest.raises(CallbackURLError, match="loopback"):
        await check_callback_url("http://localhost:8080/cb", allow_private=False)
    with pytest.raises(CallbackURLError, match="does not resolve"):
        await check_callback_url("http://no-such-host.invalid/cb", allow_private=True)


def test_signature_round_trip() -> None:
    body = b'{"batch_id": "b"}'
    header = sign("secret", body, timestamp=1_700_000_000)
    assert verify_signature("secret", header, body, now=1_700_000_010)
    assert not verify_signature("other", header, body, now=1_700_000_010)
    assert not verify_signature("secret", header, body + b" ", now=1_700_000_010)
    assert not verify_signature("secret", header, body, now=1_700_001_000)  # too old: replay
    assert not verify_signature("secret", "garbage", body)


async def test_callbacks_are_checked_again_at_send_time(serve) -> None:
    hits: list[bytes] = []

    async def hook(request: web.Request) -> web.Response:
        hits.append(await request.read())
        assert verify_signature("s", request.headers["X-Duet-Signature"], hits[-1])
        return web.Response()

    receiver = web.Application()
    receiver.router.add_post("/hook", hook)
    url = await serve(receiver)
    port = url.rsplit(":", 1)[1]
    strict = CallbackSender(allow_private=False, timeout_s=5)
    lax = CallbackSender(allow_private=True, timeout_s=5)
    try:
        for target in (f"{url}/hook", f"http://localhost:{port}/hook"):
            ok, detail = await strict.send(target, "s", b"{}", "e")
            assert not ok and "not allowed" in detail, detail
        # The connector's own resolver refuses too: a name re-resolved at connect time to a
        # private address (DNS rebinding) never gets a connection.
        with pytest.raises(OSError, match="forbidden"):
            await GuardedResolver(allow_private=False).resolve("localhost", int(port))
        assert hits == []
        ok, detail = await lax.send(f"{url}/hook", "s", b'{"a": 1}', "e")
        assert ok and hits == [b'{"a": 1}'], detail
    finally:
        await strict.close()
        await lax.close()
