"""The seam external providers plug into (gateway/backends/base.py): a model of kind "external" is
served by any `Backend`, with no local tokenizer. The providers package is another issue; a
minimal backend stands in for it here to pin the contract the API layer relies on: the Request
and Attempt it gets, the Accounting its Reply returns, and the usage record and reservation that
follow."""

from __future__ import annotations

import dataclasses
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


class ScriptedBackend(Backend):
    def __init__(self) -> None:
        self.jobs: list[tuple[Request, Attempt]] = []

    def open(self, request: Request, attempt: Attempt) -> Reply:
        self.jobs.append((request, attempt))
        return Reply(lambda out: self._pieces(request, out))

    async def _pieces(self, request: Request, out: Accounting) -> AsyncIterator[Piece]:
        out.prompt_tokens, out.model_used, out.nodes = 11, "provider-model-v2", ["provider:test"]
        for i in range(request.n):
            for word in ("hello", " there"):
                out.completion_tokens[i] = out.completion_tokens.get(i, 0) + 1
                yield Piece(index=i, text=word)
            yield Piece(index=i, text="", finish_reason="stop")


async def test_external_model_through_the_api(tiny_llama: Path, tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "store": {"url": f"sqlite://{tmp_path / 'g.db'}"},
            "models": {
                "tiny": {"tokenizer": str(tiny_llama), "static": {"both": ["http://127.0.0.1:9"]}}
            },
        }
    )
    app = make_app(cfg)
    backend = ScriptedBackend()
    async with TestClient(TestServer(app)) as client:
        state = app[STATE]
        ext = ModelConfig(
            name="ext", kind="external", input_usd_per_mtok=1.0, output_usd_per_mtok=3.0
        )
        state.serving.models["ext"] = ServedModel(ext, backend, None, 1 << 20)
        await state.store.create_team(Team(id="t", tpm=10_000))
        key, secret, digest = new_key("t")
        await state.store.create_key(key, digest)
        oai = openai.AsyncOpenAI(
            base_url=str(client.make_url("/v1")), api_key=secret, max_retries=0
        )
        r = await oai.chat.completions.create(
            model="ext", messages=[{"role": "user", "content": "hi " * 30}], n=2, max_tokens=5
        )
        assert [c.message.content for c in r.choices] == ["hello there"] * 2
        assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == 4
        req, job = backend.jobs[0]
        assert (
            req.endpoint == "chat"
            and job.prompt_ids == []
            and req.messages == [{"role": "user", "content": "hi " * 30}]
        )
        assert job.max_tokens == 5 and req.n == 2 and job.tier == "interactive"
        r2 = await oai.completions.create(model="ext", prompt="complete me", max_tokens=3)
        assert r2.choices[0].text == "hello there" and backend.jobs[1][0].prompt == "complete me"
        rows = await state.store.usage_records("t", 0, 1e12)
        x = rows[0]
        assert (x.model_requested, x.model_used, x.prompt_tokens, x.completion_tokens, x.nodes) == (
            "ext",
            "provider-model-v2",
            11,
            4,
            ["provider:test"],
        )
        assert rows[0].cost_usd == (11 * 1.0 + 4 * 3.0) / 1e6
        assert dataclasses.asdict(rows[1])["status"] == "ok"
