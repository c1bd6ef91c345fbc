"""One trace per request across the gateway, the coordinator and both nodes.

Every process of a real P/D cluster exports its spans over OTLP/HTTP to a receiver the test
runs (tests/observe/otlp.py decodes the protobuf); one chat request must give one trace whose
tree is exactly gateway → coordinator (route), gateway → prefill leg → P's queue/compute/hold,
gateway → decode leg → D's reserve/KV pull (→ P's release)/first token/generate, with the token
counts and the KV bytes moved in their attributes (GenAI semantic-convention names).
"""

from __future__ import annotations

from runtime.tracing import DEFAULT_RING, Tracing, TracingConfig, env_enabled, from_env, setup
from tests.gateway.helpers import metric
from tests.observe.conftest import MODEL, Traced
from tests.observe.otlp import Span
from tests.wait import wait_for

PROMPT = "Trace this request through every hop of the cluster, please: " * 3


def _one(spans: list[Span], name: str, service: str) -> Span:
    got = [s for s in spans if s.name == name and s.service == service]
    assert len(got) == 1, (name, service, [(s.service, s.name) for s in spans])
    return got[0]


def test_one_trace_spans_gateway_coordinator_prefill_and_decode(traced: Traced) -> None:
    c = traced
    pulled = metric(c.decode.url, "duet:kv_transfer_bytes_total")
    raw = c.client().chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=0,
        stream=False,
    )
    rid, answer = raw.headers["x-request-id"], raw.parse()
    moved = metric(c.decode.url, "duet:kv_transfer_bytes_total") - pulled
    assert moved > 0  # really disaggregated

    def root() -> Span | None:
        return next(
            (s for s in c.receiver.spans if s.attributes.get("duet.request_id") == rid), None
        )

    gw = wait_for(root, 15, "the gateway's request span")
    # every span read below: each process exports in batches, so P's release server span (it ends
    # after D's pull) can arrive after the rest (CI once took the snapshot without it)
    names = {
        "duet-gateway": {
            "gateway.auth",
            "gateway.tokenize",
            "gateway.quota.reserve",
            f"chat {MODEL}",
            "gateway.usage.commit",
            "gateway.route",
            "gateway.prefill_leg",
            "gateway.decode_leg",
            "gateway.first_token",
        },
        "duet-coordinator": {"POST /route", "coordinator.decide"},
        "duet-prefill": {
            "POST /v1/completions",
            "prefill.queue",
            "prefill.compute",
            "prefill.hold",
            "POST /kv/release",
        },
        "duet-decode": {
            "POST /v1/completions",
            "decode.reserve",
            "decode.kv_pull",
            "decode.first_token",
            "decode.generate",
        },
    }
    wait_for(
        lambda: all(
            n <= {s.name for s in c.receiver.trace(gw.trace_id) if s.service == svc}
            for svc, n in names.items()
        ),
        15,
        "every process's spans",
    )
    spans = c.receiver.trace(gw.trace_id)
    by_id = {s.span_id: s for s in spans}
    assert gw.parent_id is None and gw.name == "POST /v1/chat/completions"
    # the request span carries the GenAI attributes and the usage the client got
    assert gw.attributes["gen_ai.operation.name"] == "chat"
    assert gw.attributes["gen_ai.request.model"] == MODEL
    assert gw.attributes["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
    assert gw.attributes["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens > 0
    assert gw.attributes["gen_ai.request.max_tokens"] == 6
    assert list(gw.attributes["gen_ai.response.finish_reasons"]) == [
        answer.choices[0].finish_reason
    ]
    assert gw.attributes["gen_ai.response.id"] == answer.id
    assert gw.attributes["duet.nodes"] == ["prefill-0", "decode-0"]

    def child(name: str, service: str, parent: Span) -> Span:
        s = _one(spans, name, service)
        assert s.parent_id == parent.span_id, (name, by_id.get(s.parent_id or ""))
        assert parent.start_ns <= s.start_ns, name
        # within a process a child ends before its parent; across one, a streamed server span
        # may end after its client stopped reading at [DONE]
        assert s.service != parent.service or s.end_ns <= parent.end_ns + 1_000_000, name
        return s

    for name in ("gateway.auth", "gateway.tokenize", "gateway.quota.reserve"):
        child(name, "duet-gateway", gw)
    assert (
        _one(spans, "gateway.tokenize", "duet-gateway").attributes["gen_ai.usage.input_tokens"]
        == answer.usage.prompt_tokens
    )
    # the call to the model, named as OTel's GenAI conventions say: `{operation} {model}`, CLIENT
    relay = child(f"chat {MODEL}", "duet-gateway", gw)
    assert relay.kind == 3  # SPAN_KIND_CLIENT in OTLP
    assert {
        k: relay.attributes[k]
        for k in (
            "gen_ai.operation.name",
            "gen_ai.provider.name",
            "gen_ai.request.model",
            "gen_ai.response.model",
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.output_tokens",
        )
    } == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "duet",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
        "gen_ai.usage.input_tokens": answer.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": answer.usage.completion_tokens,
    }
    child("gateway.usage.commit", "duet-gateway", relay)
    # gateway → coordinator: the decision and its reason
    route = child("gateway.route", "duet-gateway", relay)
    assert route.attributes["duet.route.reason"].startswith("disaggregated")
    c_server = child("POST /route", "duet-coordinator", route)
    decide = child("coordinator.decide", "duet-coordinator", c_server)
    assert decide.attributes["duet.route.outcome"] == "disaggregated"
    assert decide.attributes["duet.prefill.node_id"] == "prefill-0"
    assert decide.attributes["duet.decode.node_id"] == "decode-0"
    # the prefill leg: queue, compute, and the hold D's release ends
    p_leg = child("gateway.prefill_leg", "duet-gateway", relay)
    assert p_leg.attributes["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
    p_server = child("POST /v1/completions", "duet-prefill", p_leg)
    assert p_server.attributes["duet.leg"] == "prefill"
    child("prefill.queue", "duet-prefill", p_server)
    compute = child("prefill.compute", "duet-prefill", p_server)
    assert compute.attributes["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
    hold = _one(spans, "prefill.hold", "duet-prefill")
    assert hold.parent_id == p_server.span_id and hold.attributes["duet.outcome"] == "released"
    # the decode leg: reserve, the KV pull (bytes, transport), first token, generation
    d_leg = child("gateway.decode_leg", "duet-gateway", relay)
    assert d_leg.attributes["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
    child("gateway.first_token", "duet-gateway", d_leg)
    d_server = child("POST /v1/completions", "duet-decode", d_leg)
    assert d_server.attributes["duet.leg"] == "decode"
    child("decode.reserve", "duet-decode", d_server)
    pull = child("decode.kv_pull", "duet-decode", d_server)
    assert pull.attributes["duet.kv.outcome"] == "ok"
    assert pull.attributes["duet.kv.bytes"] == moved
    assert pull.attributes["duet.kv.transport"] in ("nixl", "tcp", "ucx")
    release = _one(
        spans, "POST /kv/release", "duet-prefill"
    )  # D → P carries the pull's traceparent
    assert release.parent_id == pull.span_id
    first = child("decode.first_token", "duet-decode", d_server)
    gen = child("decode.generate", "duet-decode", d_server)
    assert pull.end_ns <= first.start_ns + 1_000_000 and first.end_ns <= gen.start_ns + 1_000_000
    # P holds the blocks from its answer until D's release, which ends the pull
    assert hold.start_ns <= pull.start_ns <= release.start_ns and hold.end_ns <= pull.end_ns


def test_off_by_default_and_on_by_env() -> None:
    assert env_enabled({}) is None
    assert env_enabled({"DUET_TRACING": "1"}) is True
    assert env_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}) is True
    assert (
        env_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"})
        is False
    )
    off = setup("t", TracingConfig())
    assert not off.enabled and off.trace_configs() == [] and off.middleware() == []
    with off.span("x") as s:
        assert s is None
    on = setup("t", TracingConfig(enabled=True, ring_size=4))
    assert isinstance(on, Tracing) and on.ring is not None
    with on.span("a"), on.span("b"):
        pass
    spans = on.ring.trace(on.ring.roots()[0].trace_id)
    assert [s.name for s in spans] == ["a", "b"] and spans[1].parent_id == spans[0].span_id
    on.shutdown()


def test_gateway_tracing_section_is_parsed_and_checked() -> None:
    import pytest

    from gateway.config import ConfigError, parse_config

    models = {
        "m": {"kind": "cluster", "tokenizer": "x", "static": {"both": ["http://127.0.0.1:1"]}}
    }
    cfg = parse_config(
        {
            "models": models,
            "tracing": {"enabled": True, "endpoint": "http://otel:4318", "ring_size": 10},
        }
    )
    assert cfg.tracing == TracingConfig(enabled=True, endpoint="http://otel:4318", ring_size=10)
    assert parse_config({"models": models}).tracing.enabled is False
    # the gateway keeps a ring by default; ring_size = 0 turns it off
    assert (
        from_env(DEFAULT_RING, parse_config({"models": models}).tracing).ring_size == DEFAULT_RING
    )
    assert from_env(DEFAULT_RING, TracingConfig(enabled=True, ring_size=0)).ring_size == 0
    with pytest.raises(ConfigError, match=r"\[tracing\] has unknown keys: enable"):
        parse_config({"models": models, "tracing": {"enable": True}})


def test_the_ring_lists_an_attributes_values_in_one_pass() -> None:
    """The console's Requests page asks, for each of up to 100 rows, whether the request is in
    the ring: one `values` pass answers them all (it called `find`, a scan of the whole ring,
    per row)."""
    from opentelemetry.sdk.trace import TracerProvider

    from runtime.tracing import SpanRing

    ring = SpanRing(8, "test")
    provider = TracerProvider()
    provider.add_span_processor(ring)
    tracer = provider.get_tracer("test")
    for i in range(10):  # 10 spans into a ring of 8: the first two are gone
        with tracer.start_as_current_span(
            "POST /v1/chat/completions", attributes={"duet.request_id": f"req-{i}"}
        ):
            pass
    with tracer.start_as_current_span("GET /health"):
        pass
    assert ring.values("duet.request_id") == {f"req-{i}" for i in range(3, 10)}
    assert ring.values("no.such.attribute") == set()


def test_a_rings_spans_cross_the_node_wire_with_any_attribute() -> None:
    """A node's ring answers the console as NodeSpans (node/spans.py): a sequence attribute of
    ints or bools (OTel allows them) must decode as the record's list of str, not fail the
    node's whole answer; a trace's spans come in start order, capped by `limit`."""
    import msgspec

    from protocol.node_api import NodeSpans

    on = setup("duet-prefill", TracingConfig(enabled=True, ring_size=8))
    assert on.ring is not None
    with (
        on.span("leg", {"duet.kv.block_ids": [3, 4], "duet.flags": [True], "duet.names": ["a"]}),
        on.span("step"),
    ):
        pass
    tid = on.ring.roots()[0].trace_id
    wire = msgspec.json.encode(NodeSpans(node_id="prefill-0", kept=True, spans=on.ring.trace(tid)))
    got = msgspec.json.decode(wire, type=NodeSpans)
    assert [s.name for s in got.spans] == ["leg", "step"]
    assert got.spans[0].attributes == {
        "duet.kv.block_ids": ["3", "4"],
        "duet.flags": ["True"],
        "duet.names": ["a"],
    }
    assert [s.name for s in on.ring.trace(tid, limit=1)] == ["leg"]
    on.shutdown()
