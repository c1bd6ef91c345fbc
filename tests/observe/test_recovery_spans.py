"""A migration and a fallback each leave their span in the gateway's own span ring (the one the
console's request view reads, no collector), with the attributes an operator needs to see what
happened: a migration or a fallback when one happens.

- Migration: a real decode node SIGKILLed after its first chunks (tests/gateway/faults.py), the
  stream continued on a second real node. The request's `text_completion tiny` span holds the
  first decode leg (ended in error, the tokens it streamed), then `gateway.migration` (which
  node failed, why, how many tokens had gone out) and inside it the new route and decode leg,
  whose tokens complete the answer; the usage record's legs agree.
- Fallback: a cluster model with no reachable node, falling back to an OpenAI-wire fake
  provider. The request span holds `chat dead` (ended in error, `error.type` the trigger's
  code), `gateway.fallback` (from, to, reason) and `chat gpt` (provider `openai`, the usage the
  client got), in that order.

The gateway runs in this process on a real socket (make_app), so the test reads its ring
directly: `state.tracing.ring`, as the console does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.accounts.keys import new_key
from gateway.accounts.store.base import Team
from gateway.app import STATE, make_app
from gateway.config import parse_config
from gateway.state import GatewayState
from runtime.tracing import SpanRecord
from tests.gateway.faults import KillRelay
from tests.gateway.helpers import tiny_model
from tests.gateway.test_failures import _node
from tests.gateway.test_migration import MAX, PROMPT
from tests.gateway.test_providers_e2e import GPT, external
from tests.procs import free_port, running
from tests.providers.fakes import API_KEY, FakeProvider
from tests.wait import until


def app_for(tmp: Path, models: dict[str, Any]) -> web.Application:
    cfg = parse_config(
        {
            "store": {"url": f"sqlite://{tmp / 'g.db'}"},
            "tracing": {"enabled": True},
            "models": models,
        }
    )
    return make_app(cfg)


async def team_key(state: GatewayState) -> str:
    await state.store.create_team(Team(id="t"))
    key, secret, digest = new_key("t")
    await state.store.create_key(key, digest)
    return secret


async def trace_of(state: GatewayState, rid: str) -> tuple[SpanRecord, list[SpanRecord]]:
    """The request's root span and its trace, once the root has ended (it ends after the
    stream's last byte: wait on it, not on time)."""
    ring = state.tracing.ring
    assert ring is not None
    await until(lambda: ring.find("duet.request_id", rid) is not None, what="the request's span")
    root = ring.find("duet.request_id", rid)
    assert root is not None
    return root, ring.trace(root.trace_id)


def one(spans: list[SpanRecord], name: str, parent: SpanRecord) -> SpanRecord:
    got = [s for s in spans if s.name == name and s.parent_id == parent.span_id]
    assert len(got) == 1, (name, [(s.name, s.parent_id) for s in spans])
    return got[0]


async def test_migration_span_in_the_gateways_ring(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay], closing: list[openai.AsyncOpenAI]
) -> None:
    d1, d2 = _node("decode", tiny_llama, tmp_path), _node("decode", tiny_llama, tmp_path)
    with running(d1, d2):
        relay = await KillRelay(d1, "after_chunks", 7).start()
        relays.append(relay)
        app = app_for(tmp_path, {"tiny": tiny_model(tiny_llama, decode=[relay.url, d2.url])})
        async with TestClient(TestServer(app)) as client:
            state = app[STATE]
            c = openai.AsyncOpenAI(
                base_url=str(client.make_url("/v1")), api_key=await team_key(state), max_retries=0
            )
            closing.append(c)
            stream = await c.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=MAX,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
            assert text and relay.killed
            [record] = await state.store.usage_records(
                "t", 0, 2e9
            )  # committed before the stream's end
            root, spans = await trace_of(state, record.request_id)
            call = one(spans, "text_completion tiny", root)
            assert call.attributes["gen_ai.usage.output_tokens"] == MAX and not call.error
            first = one(spans, "gateway.decode_leg", call)
            migration = one(spans, "gateway.migration", call)
            streamed = migration.attributes["duet.streamed_tokens"]
            assert first.error and first.attributes["server.address"] == relay.url
            assert first.attributes["gen_ai.usage.output_tokens"] == streamed and 0 < streamed < MAX
            assert migration.attributes["duet.migration"] == 1
            assert migration.attributes["duet.failed_node_id"] == first.attributes["duet.node_id"]
            assert migration.attributes["duet.reason"]  # what the gateway saw: the connection's end
            assert first.end_ns <= migration.start_ns
            one(spans, "gateway.route", migration)  # routed again, the dead node excluded
            second = one(spans, "gateway.decode_leg", migration)
            assert second.attributes["server.address"] == d2.url and not second.error
            assert second.attributes["gen_ai.usage.output_tokens"] == MAX - streamed
            assert root.attributes["duet.migrations"] == 1
            assert record.leg_tokens == [streamed, MAX - streamed]


async def test_fallback_span_in_the_gateways_ring(
    tmp_path: Path,
    tiny_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    closing: list[openai.AsyncOpenAI],
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    fake = FakeProvider("openai")
    runner = web.AppRunner(fake.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fake.url = f"http://127.0.0.1:{port}/v1"
    try:
        models = {
            "dead": tiny_model(
                tiny_llama, both=[f"http://127.0.0.1:{free_port()}"], fallback=["gpt"]
            ),
            "gpt": external(fake, GPT, 2),
        }
        app = app_for(tmp_path, models)
        async with TestClient(TestServer(app)) as client:
            state = app[STATE]
            c = openai.AsyncOpenAI(
                base_url=str(client.make_url("/v1")), api_key=await team_key(state), max_retries=0
            )
            closing.append(c)
            raw = await c.chat.completions.with_raw_response.create(
                model="dead", messages=[{"role": "user", "content": "are you there"}], max_tokens=16
            )
            answer = raw.parse()
            assert (
                raw.headers["x-duet-model-used"] == "gpt"
                and answer.choices[0].message.content == "echo: are you there"
            )
            root, spans = await trace_of(state, raw.headers["x-request-id"])
            dead = one(spans, "chat dead", root)
            fallback = one(spans, "gateway.fallback", root)
            gpt = one(spans, "chat gpt", root)
            assert dead.error and dead.attributes["error.type"] == "no_capacity", (
                dead.attributes
            )  # the error's code
            assert dead.attributes["gen_ai.provider.name"] == "duet"
            # no node was reached: it served nothing, so it reports no usage
            assert "gen_ai.usage.input_tokens" not in dead.attributes
            assert {k: v for k, v in fallback.attributes.items() if k != "duet.error"} == {
                "duet.fallback.from": "dead",
                "duet.fallback.to": "gpt",
                "duet.fallback.reason": "no_healthy_nodes",
            }
            assert fallback.attributes[
                "duet.error"
            ]  # the first model's error message, for the operator
            assert not gpt.error
            assert {
                k: gpt.attributes[k]
                for k in (
                    "gen_ai.operation.name",
                    "gen_ai.provider.name",
                    "gen_ai.request.model",
                    "gen_ai.usage.input_tokens",
                    "gen_ai.usage.output_tokens",
                )
            } == {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "gpt",
                "gen_ai.usage.input_tokens": answer.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": answer.usage.completion_tokens,
            }
            assert dead.end_ns <= fallback.start_ns <= gpt.start_ns
            assert root.attributes["gen_ai.response.model"] == "gpt"
    finally:
        fake.released.set()
        await runner.cleanup()
