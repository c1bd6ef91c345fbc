"""Batches run end to end against a real node: the official openai client's files + batches
calls, output equal to the same requests run one by one (greedy), cancel and expiry keeping
partial results, retries after a lost node, two runners sharing one store, and signed callbacks
that are retried."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.callback import verify_signature
from gateway.batch.config import BatchConfig
from gateway.batch.runner import BatchRunner
from tests.batch.app import EXECUTOR, RUNNER, make_app
from tests.batch.conftest import chat_lines, client, jsonl
from tests.batch.node_executor import NodeExecutor
from tests.procs import Proc, free_port
from tests.wait import until


def cfg(tmp_path: Path, **kw: Any) -> BatchConfig:
    base: dict[str, Any] = {
        "data_dir": tmp_path,
        "poll_s": 0.05,
        "retry_base_s": 0.05,
        "retry_max_s": 0.2,
        "lease_s": 10.0,
    }
    return BatchConfig(**{**base, **kw})


def parse_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(x) for x in data.splitlines() if x.strip()]


async def status_of(c: Any, batch_id: str) -> str:
    return (await c.batches.retrieve(batch_id)).status


async def test_openai_client_batch_matches_one_by_one(
    node: Proc, model_name: str, tiny_llama: Path, tmp_path: Path, serve
) -> None:
    app = make_app(cfg(tmp_path, concurrency=4), node_url=node.url, model_dir=tiny_llama)
    url = await serve(app)
    lines = chat_lines(50, model_name)
    async with client(url) as c:
        f = await c.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
        assert f.purpose == "batch" and f.status == "processed"
        b = await c.batches.create(
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "nightly"},
        )
        assert b.status == "in_progress" and b.request_counts.total == 50
        assert b.expires_at - b.created_at == 86_400
        await until(lambda: _is(c, b.id, "completed"), what="batch completed")
        b = await c.batches.retrieve(b.id)
        assert b.request_counts.completed == 50 and b.request_counts.failed == 0
        assert b.finalizing_at and b.completed_at and b.in_progress_at
        assert b.error_file_id is None and b.output_file_id
        out = parse_jsonl(await (await c.files.content(b.output_file_id)).aread())
        meta = await c.files.retrieve(b.output_file_id)
        assert meta.purpose == "batch_output"
        assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]  # input order
        assert len({o["id"] for o in out}) == 50
        # The oracle: the same requests, one at a time, straight to the node.
        ex: NodeExecutor = app[EXECUTOR]
        for o, x in zip(out, lines, strict=True):
            assert o["error"] is None and o["response"]["status_code"] == 200
            assert o["response"]["request_id"]
            status, alone = await ex(
                "team-a", x["url"], x["body"], request_id=f"alone-{x['custom_id']}"
            )
            assert status == 200
            got = o["response"]["body"]
            assert got["choices"][0]["message"] == alone["choices"][0]["message"], x["custom_id"]
            assert got["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]
        assert len({o["response"]["body"]["choices"][0]["message"]["content"] for o in out}) > 1
        # Every executor call ran at batch tier for the owning team.
        assert {t for t, _ in ex.calls} == {"team-a"}


async def _is(c: Any, batch_id: str, status: str) -> bool:
    return await status_of(c, batch_id) == status


async def _counts(c: Any, batch_id: str) -> Any:
    return (await c.batches.retrieve(batch_id)).request_counts


async def test_cancel_keeps_partial_results(
    node: Proc, model_name: str, tiny_llama: Path, tmp_path: Path, serve
) -> None:
    gate = {"open": True}
    app = make_app(
        cfg(tmp_path, concurrency=1),
        node_url=node.url,
        model_dir=tiny_llama,
        may_run=lambda: gate["open"],
    )
    url = await serve(app)
    lines = chat_lines(20, model_name)
    async with client(url) as c:
        f = await c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        b = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        async def three_done() -> bool:
            if (await _counts(c, b.id)).completed >= 3:
                gate["open"] = False  # the interactive-load hook: no new batch work starts
                return True
            return False

        await until(three_done, what="3 requests done")
        await until(lambda: _idle(app), what="in-flight requests to finish")
        done = (await _counts(c, b.id)).completed
        assert 3 <= done < 20
        cancelling = await c.batches.cancel(b.id)
        assert cancelling.status in ("cancelling", "cancelled")
        await until(lambda: _is(c, b.id, "cancelled"), what="cancelled")
        b = await c.batches.retrieve(b.id)
        assert b.cancelled_at and b.request_counts.completed == done
        out = parse_jsonl(await (await c.files.content(b.output_file_id)).aread())
        err = parse_jsonl(await (await c.files.content(b.error_file_id)).aread())
        assert len(out) == done and all(o["response"]["status_code"] == 200 for o in out)
        assert len(err) == 20 - done and {e["error"]["code"] for e in err} == {"batch_cancelled"}
        assert sorted(o["custom_id"] for o in out + err) == sorted(x["custom_id"] for x in lines)
        with pytest.raises(Exception, match="cannot be cancelled"):
            await c.batches.cancel(b.id)
        # Nothing ran after the cancel, even with the gate open again.
        gate["open"] = True
        app[RUNNER].wake()
        calls = len(app[EXECUTOR].calls)
        await app[RUNNER].tick()
        assert len(app[EXECUTOR].calls) == calls


async def _idle(app: web.Application) -> bool:
    return app[RUNNER].running == 0


async def test_expiry_keeps_partial_results(
    node: Proc, model_name: str, tiny_llama: Path, tmp_path: Path, serve
) -> None:
    gate = {"open": True}
    app = make_app(
        cfg(tmp_path, concurrency=1, completion_windows={"24h": 3.0}),
        node_url=node.url,
        model_dir=tiny_llama,
        may_run=lambda: gate["open"],
    )
    url = await serve(app)
    lines = chat_lines(10, model_name)
    async with client(url) as c:
        f = await c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        b = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        async def two_done() -> bool:
            if (await _counts(c, b.id)).completed >= 2:
                gate["open"] = False
                return True
            return False

        await until(two_done, what="2 requests done")
        await until(lambda: _is(c, b.id, "expired"), what="expired")
        b = await c.batches.retrieve(b.id)
        done = b.request_counts.completed
        assert 2 <= done < 10 and b.expired_at and b.expired_at >= b.expires_at
        out = parse_jsonl(await (await c.files.content(b.output_file_id)).aread())
        err = parse_jsonl(await (await c.files.content(b.error_file_id)).aread())
        assert len(out) == done and len(err) == 10 - done
        assert {e["error"]["code"] for e in err} == {"batch_expired"} and all(
            e["response"] is None for e in err
        )


async def test_retries_after_the_node_is_lost(
    node: Proc, model_name: str, tiny_llama: Path, tmp_path: Path, serve
) -> None:
    # The executor first points at a port where no node listens (a lost node): every call fails
    # to connect and is retried with backoff; once a node is back the batch completes.
    dead = f"http://127.0.0.1:{free_port()}"
    app = make_app(
        cfg(tmp_path, concurrency=2, max_attempts=50), node_url=dead, model_dir=tiny_llama
    )
    url = await serve(app)
    lines = chat_lines(6, model_name)
    async with client(url) as c:
        f = await c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        b = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        ex: NodeExecutor = app[EXECUTOR]

        async def retried() -> bool:
            return len(ex.calls) >= 8

        await until(retried, what="failed attempts")
        assert (await _counts(c, b.id)).completed == 0
        ex.node_url = node.url
        await until(lambda: _is(c, b.id, "completed"), what="completed")
        b = await c.batches.retrieve(b.id)
        assert b.request_counts.completed == 6 and b.error_file_id is None
        out = parse_jsonl(await (await c.files.content(b.output_file_id)).aread())
        assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)


async def test_failures_are_recorded_after_max_attempts_or_at_once(
    node: Proc, model_name: str, tiny_llama: Path, tmp_path: Path, serve
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    app = make_app(cfg(tmp_path, max_attempts=3), node_url=dead, model_dir=tiny_llama)
    url = await serve(app)
    ex: NodeExecutor = app[EXECUTOR]
    async with client(url) as c:
        # A lost node, for good: each request is tried max_attempts times, then fails.
        f = await c.files.create(
            file=("in.jsonl", jsonl(chat_lines(2, model_name))), purpose="batch"
        )
        b = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await until(lambda: _is(c, b.id, "completed"), what="completed")
        b = await c.batches.retrieve(b.id)
        assert b.request_counts.failed == 2 and b.output_file_id is None
        err = parse_jsonl(await (await c.files.content(b.error_file_id)).aread())
        assert {e["error"]["code"] for e in err} == {"executor_error"}
        assert all(e["response"] is None for e in err)
        assert len(ex.calls) == 6
        # The node's own refusal (unknown model, 404) is the request's answer: not retried.
        ex.node_url = node.url
        lines = chat_lines(1, model_name)
        lines[0]["body"]["model"] = "not-this-node"
        f = await c.files.create(file=("in2.jsonl", jsonl(lines)), purpose="batch")
        b = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await until(lambda: _is(c, b.id, "completed"), what="completed")
        b = await c.batches.retrieve(b.id)
        assert b.request_counts.failed == 1 and len(ex.calls) == 7
        [e] = parse_jsonl(await (await c.files.content(b.error_file_id)).aread())
        assert e["error"] is None and e["response"]["status_code"] == 404
        assert e["response"]["body"]["error"]["code"] == "model_not_found"


async def test_two_runners_share_a_store_without_running_anything_twice(
    node: Proc, model_name: str, tiny_llama: Path, tmp_path: Path, serve
) -> None:
    app = make_app(
        cfg(tmp_path, concurrency=3, worker_id="gw-1"), node_url=node.url, model_dir=tiny_llama
    )
    url = await serve(app)
    # A second gateway: its own connection to the same database file, its own executor.
    store2 = SqliteBatchStore(tmp_path / "batch.sqlite3")
    async with aiohttp.ClientSession() as session:
        ex2 = NodeExecutor(session, node.url, tiny_llama)
        runner2 = BatchRunner(store2, ex2, cfg(tmp_path, concurrency=3, worker_id="gw-2"))
        await runner2.start()
        try:
            lines = chat_lines(40, model_name)
            async with client(url) as c:
                f = await c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
                b = await c.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                await until(lambda: _is(c, b.id, "completed"), what="completed")
                out = parse_jsonl(
                    await (
                        await c.files.content((await c.batches.retrieve(b.id)).output_file_id)
                    ).aread()
                )
        finally:
            await runner2.stop()
            store2.close()
    ran = Counter(app[EXECUTOR].calls_by_user + ex2.calls_by_user)
    assert sorted(ran) == sorted(x["custom_id"] for x in lines) and set(ran.values()) == {1}
    assert app[EXECUTOR].calls_by_user and ex2.calls_by_user  # both did work
    assert sorted(o["custom_id"] for o in out) == sorted(ran)


async def test_callback_is_signed_and_retried(
    node: Proc, model_name: str, tiny_llama: Path, tmp_path: Path, serve
) -> None:
    received: list[tuple[int, bytes, str, bool]] = []

    async def receive(request: web.Request) -> web.Response:
        raw = await request.read()
        sig = request.headers.get("X-Duet-Signature", "")
        ok = verify_signature("team-a-secret", sig, raw)
        received.append((len(received) + 1, raw, request.headers.get("X-Duet-Event-Id", ""), ok))
        return web.Response(status=500 if len(received) == 1 else 200)  # fail the first delivery

    receiver = web.Application()
    receiver.router.add_post("/hook", receive)
    recv_url = await serve(receiver)
    app = make_app(
        cfg(
            tmp_path,
            allow_private_callbacks=True,
            callback_secret="default",
            callback_secrets={"team-a": "team-a-secret"},
            callback_retry_base_s=0.1,
            max_priorities={"team-a": 2},
        ),
        node_url=node.url,
        model_dir=tiny_llama,
    )
    url = await serve(app)
    reqs = [x["body"] for x in chat_lines(5, model_name)]
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as s:
        async with s.post(
            url + "/v1/batch",
            json={"requests": reqs, "callback_url": recv_url + "/hook", "priority": "high"},
        ) as r:
            assert r.status == 202, await r.text()
            created = await r.json()

        async def delivered() -> bool:
            return len(received) >= 2

        await until(delivered, what="callback delivered after a failure")
        async with s.get(url + f"/v1/batch/{created['batch_id']}") as r:
            st = await r.json()
    assert [ok for *_, ok in received] == [True, True]
    payload = json.loads(received[1][1])
    assert payload["batch_id"] == created["batch_id"] and payload["status"] == "completed"
    assert payload["type"] == "batch.completed" and payload["request_counts"]["completed"] == 5
    assert received[0][2] == received[1][2] == f"{created['batch_id']}:completed"  # dedupe key
    assert st["status"] == "completed" and [x["custom_id"] for x in st["results"]] == [
        f"request-{i}" for i in range(1, 6)
    ]
    assert all(x["response"]["status_code"] == 200 for x in st["results"])
    # Delivered means no more attempts.
    await app[RUNNER].tick()
    assert len(received) == 2
