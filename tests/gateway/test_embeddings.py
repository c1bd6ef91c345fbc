"""`POST /v1/embeddings` end to end with every real part: an etcd, a coordinator, an embed node
(`duet node --task embed`, SmolLM2 in fp32) and a generation node of the same model registered
beside it, and the gateway routing through the coordinator — driven by the official openai
client (which asks for base64 by default).

One module-scoped cluster; the checks: one dimension for every item, equal inputs equal and
different ones differ, the vector equals transformers' (the oracle: last token's final hidden
state, normalized), float and base64 agree, token-id inputs equal their text, `dimensions`
truncates and renormalizes, concurrent requests all answer right, the refusals (2,049 items,
empty, mixed, over the context, bad dimensions, the wrong kind of model either way), usage
equal to the tokenizer's count, the usage record and its cost in the store, and the task
split: embeddings never reach the generation node and completions never the embed node.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
import torch.nn.functional as F

from coordinator.etcd_server import EtcdServer
from tests.engine.oracle import hf_model
from tests.gateway.helpers import gateway_proc, make_team, metric
from tests.procs import Proc, duet_node, free_port, running
from tests.wait import wait_for
from text.tokenizer import Tokenizer

pytestmark = pytest.mark.smollm2

EMBED, GEN = "smol-embed", "smol"
PRICE = 0.5  # USD per million prompt tokens
MAX_LEN = 512
#: 256 blocks: 2,048 one-token inputs (a block each) run in 8 forwards of 256
EMBED_ARGS = (
    "--task",
    "embed",
    "--dtype",
    "float32",
    "--kv-blocks",
    "256",
    "--max-model-len",
    str(MAX_LEN),
)
GEN_ARGS = ("--dtype", "float32", "--kv-blocks", "128", "--max-model-len", "1024")


@dataclass
class Cluster:
    embed: Proc
    gen: Proc
    gateway: Proc
    key: str
    model_dir: Path
    db: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=self.key, max_retries=0)


def _coordinator_nodes(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(url + "/cluster", timeout=5) as r:
        return {n["node_id"]: n for n in json.loads(r.read())["nodes"]}


@pytest.fixture(scope="module")
def cluster(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("embeddings")
    with EtcdServer(tmp / "etcd") as etcd:
        port = free_port()
        coord = Proc(
            [sys.executable, "-m", "duet", "coordinator", "--etcd", etcd.url, "--port", str(port)],
            port,
            tmp / "coordinator.log",
        )
        e = duet_node(
            "both", str(smollm2), tmp, *EMBED_ARGS, "--etcd", etcd.url, "--node-id", "embed-0"
        )
        g = duet_node(
            "both", str(smollm2), tmp, *GEN_ARGS, "--etcd", etcd.url, "--node-id", "gen-0"
        )
        common = {"tokenizer": str(smollm2), "served_name": smollm2.name}
        models = {
            EMBED: {
                "kind": "embedding",
                "input_usd_per_mtok": PRICE,
                "max_model_len": MAX_LEN,
                **common,
            },
            GEN: {
                "kind": "cluster",
                "input_usd_per_mtok": 1.0,
                "output_usd_per_mtok": 2.0,
                **common,
            },
        }
        gw = gateway_proc(tmp, models, routing={"coordinator": [coord.url]})
        with running(coord, e, g, gw):
            wait_for(
                lambda: (
                    all(n["ready"] for n in _coordinator_nodes(coord.url).values())
                    and len(_coordinator_nodes(coord.url)) == 2
                ),
                60,
                "both nodes ready",
            )
            nodes = _coordinator_nodes(coord.url)
            assert nodes["embed-0"]["task"] == "embed" and nodes["gen-0"]["task"] == "generate"
            yield Cluster(e, g, gw, make_team(gw.url, "rag"), smollm2, tmp / "gateway.db")


def _hf_last(model_dir: Path, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        h = hf_model(model_dir)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][
            0, -1
        ]
    return F.normalize(h.float(), dim=0)


TEXTS = [
    "The cat sat on the mat.",
    "Quantum chromodynamics describes the strong force.",
    "The cat sat on the mat.",
    "Bonjour tout le monde",
]


def test_vectors_float_base64_tokens_and_usage(cluster: Cluster) -> None:
    c, tok = cluster.client(), Tokenizer(cluster.model_dir)
    gen_before, embed_before = (
        metric(cluster.gen.url, "duet:prompt_tokens_total"),
        metric(cluster.embed.url, "duet:prompt_tokens_total"),
    )
    r = c.embeddings.create(model=EMBED, input=TEXTS, user="alice")  # the client asks for base64
    assert r.object == "list" and r.model == EMBED and [d.index for d in r.data] == [0, 1, 2, 3]
    vecs = torch.tensor([d.embedding for d in r.data])
    assert vecs.shape == (4, 576) and torch.allclose(vecs.norm(dim=1), torch.ones(4), atol=1e-5)
    assert torch.equal(vecs[0], vecs[2]) and not torch.allclose(vecs[0], vecs[1], atol=1e-3)
    assert (vecs[0] - vecs[3]).abs().max() > 1e-3
    n_tokens = sum(len(tok.encode(t)) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens
    # the oracle: transformers' last hidden state of the last token, normalized
    assert torch.allclose(vecs[1], _hf_last(cluster.model_dir, tok.encode(TEXTS[1])), atol=1e-3)
    f = c.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    assert torch.allclose(torch.tensor([d.embedding for d in f.data]), vecs, atol=1e-6)
    # token-id inputs: one array, and an array of arrays
    ids = [tok.encode(t) for t in TEXTS[:2]]
    one = c.embeddings.create(model=EMBED, input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and torch.allclose(
        torch.tensor(one.data[0].embedding), vecs[0], atol=1e-5
    )
    two = c.embeddings.create(model=EMBED, input=ids, encoding_format="float")
    assert torch.allclose(torch.tensor([d.embedding for d in two.data]), vecs[:2], atol=1e-5)
    assert two.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    # dimensions: the first 64 components, normalized again
    cut = c.embeddings.create(model=EMBED, input=TEXTS[:2], dimensions=64)
    cv = torch.tensor([d.embedding for d in cut.data])
    assert cv.shape == (2, 64) and torch.allclose(cv, F.normalize(vecs[:2, :64], dim=1), atol=1e-5)
    # embeddings ran on the embed node, never on the generation node
    assert metric(cluster.embed.url, "duet:prompt_tokens_total") >= embed_before + n_tokens
    assert metric(cluster.gen.url, "duet:prompt_tokens_total") == gen_before


def test_usage_record_and_billing(cluster: Cluster) -> None:
    c, tok = cluster.client(), Tokenizer(cluster.model_dir)
    text = "billing check: " + "one two three " * 20
    n = len(tok.encode(text))
    raw = c.embeddings.with_raw_response.create(model=EMBED, input=[text, text], user="bob")
    rid = raw.headers["x-request-id"]
    assert raw.parse().usage.prompt_tokens == 2 * n
    assert float(raw.headers["x-duet-cost-usd"]) == pytest.approx(2 * n * PRICE / 1e6)
    with sqlite3.connect(cluster.db) as db:
        row = db.execute(
            "SELECT endpoint, status, model_used, prompt_tokens, completion_tokens, cost_usd, "
            "user, nodes FROM usage WHERE request_id = ?",
            (rid,),
        ).fetchone()
    assert row[:7] == (
        "embedding",
        "ok",
        EMBED,
        2 * n,
        0,
        pytest.approx(2 * n * PRICE / 1e6),
        "bob",
    )
    assert "embed-0" in row[7]


def test_2048_items_in_one_request(cluster: Cluster) -> None:
    words = ["alpha", "beta", "gamma", "delta"]
    r = cluster.client().embeddings.create(model=EMBED, input=[words[i % 4] for i in range(2048)])
    assert len(r.data) == 2048 and [d.index for d in r.data] == list(range(2048))
    assert r.data[0].embedding == r.data[4].embedding != r.data[1].embedding
    tok = Tokenizer(cluster.model_dir)
    assert r.usage.prompt_tokens == 512 * sum(len(tok.encode(w)) for w in words)


def test_concurrent_requests_are_each_answered_right(cluster: Cluster) -> None:
    """Requests arriving together share the node's forwards; each gets its own vectors."""
    c = openai.AsyncOpenAI(base_url=cluster.gateway.url + "/v1", api_key=cluster.key, max_retries=0)
    texts = [f"document number {i} is about topic {i % 3}" for i in range(12)]

    async def go() -> tuple[list, list]:
        alone = [
            (await c.embeddings.create(model=EMBED, input=t, encoding_format="float"))
            .data[0]
            .embedding
            for t in texts[:3]
        ]
        rs = await asyncio.gather(
            *(c.embeddings.create(model=EMBED, input=t, encoding_format="float") for t in texts)
        )
        return alone, [r.data[0].embedding for r in rs]

    alone, together = asyncio.run(go())
    got = torch.tensor(together)
    assert torch.allclose(got[:3], torch.tensor(alone), atol=1e-5)
    assert len({tuple(v[:8]) for v in together}) == len(texts)  # all different


@pytest.mark.parametrize(
    ("kwargs", "param", "what"),
    [
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", "is empty"),
        ({"input": ["a", 5]}, "input", "not a mix"),
        ({"input": [[1, 2], []]}, "input", "input[1] is empty"),
        ({"input": [[1, 10**9]]}, "input", "out of the vocabulary"),
        ({"input": "x", "dimensions": 577}, "dimensions", "at most 576"),
        ({"input": "x", "dimensions": 0}, "dimensions", "at least 1"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "hex"),
        ({"input": "x", "user": "u" * 300}, "user", "256"),
        ({"input": "word " * (MAX_LEN + 10)}, "input", "maximum context length"),
    ],
    ids=[
        "2049",
        "empty-list",
        "empty-string",
        "mixed",
        "empty-tokens",
        "vocab",
        "dims-high",
        "dims-zero",
        "format",
        "user",
        "context",
    ],
)
def test_refusals(cluster: Cluster, kwargs: dict, param: str, what: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client().embeddings.create(model=EMBED, **kwargs)
    assert e.value.status_code == 400 and what in e.value.message and e.value.body["param"] == param


def test_wrong_kind_of_model_both_ways_and_the_task_split(cluster: Cluster) -> None:
    c = cluster.client()
    with pytest.raises(openai.BadRequestError, match="text generation model"):
        c.embeddings.create(model=GEN, input="x")
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        c.chat.completions.create(
            model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        c.completions.create(model=EMBED, prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="nope", input="x")
    # a completion on the generation model runs on the generation node, never on the embed node
    embed_before, gen_before = (
        metric(cluster.embed.url, "duet:prompt_tokens_total"),
        metric(cluster.gen.url, "duet:prompt_tokens_total"),
    )
    r = c.completions.create(
        model=GEN, prompt="The capital of France is", max_tokens=2, temperature=0
    )
    assert r.usage.completion_tokens >= 1
    assert metric(cluster.embed.url, "duet:prompt_tokens_total") == embed_before
    assert metric(cluster.gen.url, "duet:prompt_tokens_total") > gen_before
    models = {m.id: m for m in c.models.list().data}
    assert models[EMBED].owned_by == "duet"


def test_nodes_refuse_the_other_task(cluster: Cluster) -> None:
    """Each node's own API: an embed node refuses completions (400 wrong_task); a generation node
    has no embeddings route (404)."""
    from tests.gateway.helpers import http

    status, _, body = http(
        cluster.embed.url + "/v1/completions", "POST", {"prompt": [1, 2], "max_tokens": 2}, key=None
    )
    assert status == 400 and body["error"]["code"] == "wrong_task"
    status, _, body = http(
        cluster.gen.url + "/v1/embeddings", "POST", {"inputs": [[1, 2]]}, key=None
    )
    assert status == 404
    status, _, body = http(
        cluster.embed.url + "/v1/embeddings",
        "POST",
        {"inputs": [[1, 2]], "dimensions": 9999},
        key=None,
    )
    assert status == 400 and "between 1 and 576" in body["error"]["message"]
