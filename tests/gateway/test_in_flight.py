"""The gateway's registry of in-flight ledgers: a request is in
`Books.in_flight` from its reservation to its settlement, whatever the answer's shape;
the heartbeat's report (`Books.streamed_report`) names a stream's reservation with the tokens
its client was sent, only when the count grew since the last report, and never a whole
(non-streamed) answer, which reaches its client only at the end.

In process (aiohttp's test server) with a backend that holds its answer mid-way until told."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import openai
from aiohttp.test_utils import TestClient, TestServer

from gateway.accounts.keys import new_key
from gateway.accounts.store.base import Team
from gateway.app import STATE, make_app
from gateway.backends.base import Accounting, Attempt, Backend, Piece, Reply, ServedModel
from gateway.config import ModelConfig, parse_config
from gateway.serving.requests import Request
from tests.wait import until

WORDS = ("one", " two", " three")


class HeldBackend(Backend):
    """Sends WORDS, makes one more token whose text is not out yet (a byte of an unfinished
    character: no piece), then holds the answer until `release` is set."""

    def __init__(self) -> None:
        self.sent = asyncio.Event()
        self.release = asyncio.Event()

    def open(self, request: Request, attempt: Attempt) -> Reply:
        return Reply(self._pieces)

    async def _pieces(self, out: Accounting) -> AsyncIterator[Piece]:
        out.prompt_tokens, out.nodes = 11, ["provider:test"]
        for word in WORDS:
            out.completion_tokens[0] = out.completion_tokens.get(0, 0) + 1
            yield Piece(index=0, text=word, tokens=1)
        out.completion_tokens[0] += 1  # made, not sent: the heartbeat does not report it
        self.sent.set()
        await self.release.wait()
        yield Piece(index=0, text="!", finish_reason="stop", tokens=1)


async def _streamed(oai: openai.AsyncOpenAI) -> str:
    chunks = await oai.chat.completions.create(
        model="ext", messages=MESSAGES, max_tokens=8, stream=True
    )
    return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


async def _whole(oai: openai.AsyncOpenAI) -> str:
    answer = await oai.chat.completions.create(model="ext", messages=MESSAGES, max_tokens=8)
    return answer.choices[0].message.content or ""


MESSAGES = [{"role": "user", "content": "hi"}]


async def test_in_flight_ledgers_and_the_streamed_report(tiny_llama: Path, tmp_path: Path) -> None:
    # a heartbeat every 5 minutes: the app's own sweep must not report between our looks
    cfg = parse_config(
        {
            "store": {"url": f"sqlite://{tmp_path / 'g.db'}"},
            "quotas": {"heartbeat_s": 300},
            "models": {
                "tiny": {"tokenizer": str(tiny_llama), "static": {"both": ["http://127.0.0.1:9"]}}
            },
        }
    )
    app = make_app(cfg)
    async with TestClient(TestServer(app)) as client:
        state = app[STATE]
        ext = ModelConfig(
            name="ext", kind="external", input_usd_per_mtok=1.0, output_usd_per_mtok=3.0
        )
        await state.store.create_team(Team(id="t"))
        key, secret, digest = new_key("t")
        await state.store.create_key(key, digest)
        oai = openai.AsyncOpenAI(
            base_url=str(client.make_url("/v1")), api_key=secret, max_retries=0
        )
        for ask in (_streamed, _whole):
            backend = HeldBackend()
            state.serving.models["ext"] = ServedModel(ext, backend, None, 1 << 20)
            task = asyncio.ensure_future(ask(oai))
            await until(backend.sent.is_set, 30, "the backend to send its words")
            [rid] = state.serving.books.in_flight  # reserved, not settled
            if ask is _streamed:
                report = state.serving.books.streamed_report()
                assert report == {rid: len(WORDS)}  # sent, not made
                state.serving.books.streamed_reported(report)
                assert state.serving.books.streamed_report() == {}  # nothing new since
            else:
                assert state.serving.books.streamed_report() == {}  # nothing reached the client yet
            backend.release.set()
            assert await asyncio.wait_for(task, 30) == "".join(WORDS) + "!"
            assert state.serving.books.in_flight == {}  # settled: out of the registry
