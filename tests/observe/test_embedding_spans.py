"""`/v1/embeddings` leaves its GenAI span in the gateway's own span ring (the console's request
view, no collector), as chat and completions do: `embeddings {model}`, kind CLIENT, under the
request's server span, with OTel's embeddings attributes.

A real embed node (`duet node --task embed` on the tiny model) behind a gateway running in this
process on a real socket (make_app, tracing on), driven by the official openai client:
- served: the span holds `gen_ai.operation.name = embeddings`, the provider, the model asked
  and the model that answered, `gen_ai.usage.input_tokens` equal to the usage the client got,
  the encoding and the vector size; the request's root span names the request (so the console's
  Requests page lists it) and holds tokenize and quota spans beside it;
- failed: a model whose only node is down answers 503, and its span ends in error with
  `error.type` the error's code (`no_capacity`: its one node was tried, failed and was
  excluded) and no usage (nothing was served).

There is no provider-served embeddings path (an embedding model is `kind = "embedding"` on duet
nodes only, gateway/api/embeddings.py), so the self-hosted one is the one to test.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import STATE
from tests.observe.test_recovery_spans import app_for, one, team_key, trace_of
from tests.procs import TINY_NODE_ARGS, duet_node, free_port, running
from text.tokenizer import Tokenizer

TEXTS = ["The cat sat on the mat.", "a second, rather longer input to embed"]


def embedding_model(tokenizer: Path, url: str) -> dict[str, object]:
    return {
        "kind": "embedding",
        "tokenizer": str(tokenizer),
        "input_usd_per_mtok": 0.5,
        "max_model_len": 1024,
        "static": {"both": [url]},
    }


async def test_embeddings_span_served_and_failed(
    tmp_path: Path, tiny_llama: Path, closing: list[openai.AsyncOpenAI]
) -> None:
    node = duet_node("both", tiny_llama, tmp_path, *TINY_NODE_ARGS, "--task", "embed")
    with running(node):
        models = {
            "emb": embedding_model(tiny_llama, node.url),
            "down": embedding_model(tiny_llama, f"http://127.0.0.1:{free_port()}"),
        }
        app = app_for(tmp_path, models)
        async with TestClient(TestServer(app)) as client:
            state = app[STATE]
            c = openai.AsyncOpenAI(
                base_url=str(client.make_url("/v1")), api_key=await team_key(state), max_retries=0
            )
            closing.append(c)

            raw = await c.embeddings.with_raw_response.create(
                model="emb", input=TEXTS, encoding_format="float", dimensions=16
            )
            answer = raw.parse()
            assert len(answer.data) == 2 and len(answer.data[0].embedding) == 16
            n = sum(len(Tokenizer(tiny_llama).encode(t)) for t in TEXTS)
            assert answer.usage.prompt_tokens == n
            root, spans = await trace_of(state, raw.headers["x-request-id"])
            assert (
                root.name == "POST /v1/embeddings"
                and root.attributes["gen_ai.operation.name"] == "embeddings"
            )
            call = one(spans, "embeddings emb", root)
            assert (root.kind, call.kind) == (
                "server",
                "client",
            )  # OTel GenAI: the model call is CLIENT
            assert not call.error and "error.type" not in call.attributes
            assert {
                k: call.attributes[k]
                for k in (
                    "gen_ai.operation.name",
                    "gen_ai.provider.name",
                    "gen_ai.request.model",
                    "gen_ai.response.model",
                    "gen_ai.usage.input_tokens",
                    "gen_ai.embeddings.dimension.count",
                    "gen_ai.request.encoding_formats",
                )
            } == {
                "gen_ai.operation.name": "embeddings",
                "gen_ai.provider.name": "duet",
                "gen_ai.request.model": "emb",
                "gen_ai.response.model": "emb",
                "gen_ai.usage.input_tokens": n,
                "gen_ai.embeddings.dimension.count": 16,
                "gen_ai.request.encoding_formats": ["float"],
            }
            assert (
                "gen_ai.usage.output_tokens" not in call.attributes
            )  # an embedding has no output tokens
            assert (
                call.attributes["duet.nodes"]
                and root.attributes["duet.nodes"] == call.attributes["duet.nodes"]
            )
            tokenize = one(spans, "gateway.tokenize", root)
            assert (
                tokenize.attributes["gen_ai.usage.input_tokens"] == n
                and tokenize.end_ns <= call.start_ns
            )
            one(spans, "gateway.quota.reserve", root)
            assert one(spans, "gateway.usage.commit", root).start_ns >= call.end_ns
            assert (
                root.attributes["gen_ai.usage.input_tokens"] == n
                and root.attributes["duet.status"] == "ok"
            )
            # the console's Requests page lists the request (it reads the ring's request spans)
            assert state.tracing.ring is not None
            assert any(
                s.attributes.get("duet.request_id") == raw.headers["x-request-id"]
                for s in state.tracing.ring.requests()
            )

            with pytest.raises(openai.APIStatusError) as e:
                await c.embeddings.with_raw_response.create(model="down", input="nobody home")
            assert e.value.status_code == 503, e.value.body
            # its one node refused the connection and was excluded: none is left
            assert e.value.body["code"] == "no_capacity", e.value.body
            root, spans = await trace_of(state, e.value.response.headers["x-request-id"])
            failed = one(spans, "embeddings down", root)
            assert failed.error and failed.attributes["error.type"] == "no_capacity", (
                failed.attributes
            )
            assert failed.attributes["gen_ai.operation.name"] == "embeddings"
            assert (
                "gen_ai.usage.input_tokens" not in failed.attributes
            )  # no node served it: no usage
            assert root.attributes["duet.status"] == "error"
