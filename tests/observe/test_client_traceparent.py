"""A client's `traceparent` cannot put its request into another request's trace: the console
shows a trace to the team whose request made it, with the nodes' spans of it, so a team-B client
naming team A's trace id must not add its spans there. The gateway's public endpoints start a trace
of their own per request and keep the client's as a link; the internal plane (nodes, coordinator:
callers with the cluster secret) still continues its caller's trace (tests/observe/test_tracing.py
checks that hop by hop).

The gateway runs in this process on a real socket (make_app) in front of an OpenAI-wire fake
provider (a commercial API cannot exist here); the test reads its span ring as the console does.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.accounts.keys import new_key
from gateway.accounts.store.base import Team
from gateway.app import STATE
from gateway.state import GatewayState
from tests.gateway.test_providers_e2e import GPT, external
from tests.observe.test_recovery_spans import app_for, trace_of
from tests.providers.conftest import fake_openai  # noqa: F401  (the fixture: a fake OpenAI on loopback)
from tests.providers.fakes import API_KEY, FakeProvider


async def _key(state: GatewayState, team: str) -> str:
    await state.store.create_team(Team(id=team))
    key, secret, digest = new_key(team)
    await state.store.create_key(key, digest)
    return secret


async def test_a_clients_traceparent_cannot_join_another_teams_trace(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    closing: list[openai.AsyncOpenAI],
    fake_openai: FakeProvider,  # noqa: F811
) -> None:
    monkeypatch.setenv("FAKE_PROVIDER_KEY", API_KEY)
    app = app_for(tmp_path, {"gpt": external(fake_openai, GPT, 2)})
    async with TestClient(TestServer(app)) as client:
        state = app[STATE]
        a, b = [
            openai.AsyncOpenAI(
                base_url=str(client.make_url("/v1")), api_key=await _key(state, t), max_retries=0
            )
            for t in ("team-a", "team-b")
        ]
        closing.extend([a, b])
        msg = [{"role": "user", "content": "hello"}]
        raw_a = await a.chat.completions.with_raw_response.create(
            model="gpt", messages=msg, max_tokens=8
        )
        root_a, before = await trace_of(state, raw_a.headers["x-request-id"])
        # team B names team A's trace (and A's root span) in a well-formed, sampled traceparent
        parent = f"00-{root_a.trace_id}-{root_a.span_id}-01"
        raw_b = await b.chat.completions.with_raw_response.create(
            model="gpt", messages=msg, max_tokens=8, extra_headers={"traceparent": parent}
        )
        root_b, spans_b = await trace_of(state, raw_b.headers["x-request-id"])
        assert root_b.trace_id != root_a.trace_id and root_b.parent_id is None
        assert len(spans_b) > 1  # B's request is traced whole, in a trace of its own
        after = state.tracing.ring.trace(root_a.trace_id)  # type: ignore[union-attr]
        assert sorted(s.span_id for s in after) == sorted(s.span_id for s in before)
        assert all(
            s.attributes.get("duet.request_id") != raw_b.headers["x-request-id"] for s in after
        )
