"""LoRA adapters served as models, end to end with real processes: an etcd, a coordinator and
a prefill and a decode node with LoRA slots (tiny random model, tiny random PEFT adapters), all
behind the cluster secret, and a gateway routing through the coordinator; the official openai
client.

- `tiny:a0` (a `base:adapter` name, prices of its own) and `sql-bot` (a configured name over
  adapter a1, kept to team alice) answer with exactly transformers + PEFT's tokens for their
  adapter, prefilled on P and decoded on D, both running it; the coordinator loads each adapter
  on both nodes from its configured path;
- /v1/models lists them with `parent`/`root` as vLLM does, and team bob sees no `sql-bot`: its
  request gets the 404 of a model that does not exist, word for word;
- the usage records carry the adapter and its price (the adapter's own, or its base's), and
  /v1/usage groups by adapter.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.fixtures.tiny_lora import make_adapter, peft_greedy
from tests.gateway.helpers import gateway_proc, http, make_team
from tests.procs import TINY_NODE_ARGS, Proc, running, secured_plane
from tests.wait import wait_for

SECRET = secrets.token_urlsafe(24)
LORA = ("--max-loras", "2", "--max-lora-rank", "8")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = {"max_tokens": 8, "temperature": 0}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@dataclass
class Served:
    gateway: Proc
    keys: dict[str, str]
    adapters: list[Path]
    base: Path

    def client(self, team: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.gateway.url + "/v1", api_key=self.keys[team], max_retries=0
        )

    def ids(self, team: str, model: str, prompt: list[int]) -> tuple[list[int], str]:
        """The completion's token ids and its request id."""
        r = self.client(team).completions.with_raw_response.create(
            model=model, prompt=prompt, extra_body=EXTRA, **GREEDY
        )
        body = r.parse()
        return body.choices[0].model_extra["token_ids"], r.headers["x-request-id"]  # type: ignore[index]


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("adapters-gw")
    adapters = [
        make_adapter(tiny_llama, tmp / f"a{i}", 10 + i, r=4, lora_alpha=8, target_modules=ALL)
        for i in range(2)
    ]
    base = {
        "kind": "cluster",
        "tokenizer": str(tiny_llama),
        "served_name": tiny_llama.name,
        "input_usd_per_mtok": 1.0,
        "output_usd_per_mtok": 2.0,
    }
    models = {
        "tiny": base,
        "tiny:a0": {
            "adapter_path": str(adapters[0]),
            "input_usd_per_mtok": 3.0,
            "output_usd_per_mtok": 7.0,
        },
        "sql-bot": {
            "base": "tiny",
            "adapter": "a1",
            "adapter_path": str(adapters[1]),
            "teams": ["alice"],
        },
    }
    # every prompt here is longer than 8 tokens: prefilled on P, decoded on D
    with secured_plane(tmp, SECRET, "--local-prefill-tokens", "8") as plane:
        nodes = [
            plane.node(role, tiny_llama, *TINY_NODE_ARGS, *LORA, node_id=f"{role}-0")
            for role in ("prefill", "decode")
        ]
        g = gateway_proc(
            tmp, models, args=plane.flag, routing={"coordinator": [plane.coordinator.url]}
        )
        with running(plane.coordinator, *nodes, g):
            plane.wait_ready({"prefill-0", "decode-0"})
            keys = {t: make_team(g.url, t) for t in ("alice", "bob")}
            yield Served(g, keys, adapters, tiny_llama)


def _prompt(seed: int, n: int = 40) -> list[int]:
    rng = __import__("random").Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def test_each_adapter_answers_with_its_own_tokens(served: Served) -> None:
    prompt = _prompt(1)
    want = [peft_greedy(served.base, a, prompt, 8) for a in served.adapters]
    assert want[0] != want[1]
    got_a0, _ = served.ids("bob", "tiny:a0", prompt)
    got_a1, _ = served.ids("alice", "sql-bot", prompt)
    plain, _ = served.ids("bob", "tiny", prompt)
    assert got_a0 == want[0]
    assert got_a1 == want[1]
    assert plain not in want, "the base model answers without an adapter"
    # a second team on the same adapter: the same answer (its cache domain is its own)
    assert served.ids("alice", "tiny:a0", prompt)[0] == want[0]


def test_models_list_adapters_and_hide_a_kept_one(served: Served) -> None:
    by_alice = {m.id: m.model_extra for m in served.client("alice").models.list()}
    assert by_alice["tiny:a0"]["parent"] == "tiny"  # type: ignore[index]
    assert by_alice["tiny:a0"]["root"] == str(served.adapters[0])  # type: ignore[index]
    assert by_alice["sql-bot"]["parent"] == "tiny"  # type: ignore[index]
    assert "parent" not in (by_alice["tiny"] or {})
    by_bob = {m.id for m in served.client("bob").models.list()}
    assert by_bob == {"tiny", "tiny:a0"}


def test_a_team_not_allowed_gets_the_404_of_an_unknown_model(served: Served) -> None:
    bob = served.client("bob")
    errors = []
    for model in ("sql-bot", "no-such-bot"):
        with pytest.raises(openai.NotFoundError) as e:
            bob.completions.create(model=model, prompt=_prompt(2), **GREEDY)
        errors.append(e.value.body)
    kept, unknown = errors
    assert kept == {**unknown, "message": unknown["message"].replace("no-such-bot", "sql-bot")}  # type: ignore[index]
    assert "sql-bot" not in unknown["message"]  # type: ignore[index]
    assert kept["code"] == "model_not_found"  # type: ignore[index]
    # an adapter resident on the nodes but named in no table is no model either
    with pytest.raises(openai.NotFoundError):
        bob.completions.create(model="a1", prompt=_prompt(2), **GREEDY)


def test_usage_records_the_adapter_and_its_price(served: Served) -> None:
    prompt = _prompt(3)
    start = time.time() - 1
    _, rid_a0 = served.ids("alice", "tiny:a0", prompt)
    _, rid_sql = served.ids("alice", "sql-bot", prompt)
    _, rid_base = served.ids("alice", "tiny", prompt)
    key = served.keys["alice"]
    url = f"{served.gateway.url}/v1/usage?start={start}&end={time.time() + 1}"

    def records() -> dict[str, dict] | None:
        status, _, body = http(url + "&group_by=record", key=key)
        assert status == 200, body
        got = {r["request_id"]: r for r in body["data"]}
        return got if {rid_a0, rid_sql, rid_base} <= set(got) else None

    recs = wait_for(records, timeout=30, what="the usage records")
    assert recs is not None
    for rid, model, adapter, (p_in, p_out) in (
        (rid_a0, "tiny:a0", "a0", (3.0, 7.0)),  # its own prices
        (rid_sql, "sql-bot", "a1", (1.0, 2.0)),  # its base's
        (rid_base, "tiny", None, (1.0, 2.0)),
    ):
        r = recs[rid]
        assert (r["model_used"], r["adapter"], r["status"]) == (model, adapter, "ok")
        assert (r["prompt_tokens"], r["completion_tokens"]) == (len(prompt), 8)
        assert r["nodes"] == "prefill-0 decode-0", "both legs ran it (with the adapter)"
        # (a cached prompt token costs the input price: no model here sets a cached price)
        assert r["cost_usd"] == pytest.approx((len(prompt) * p_in + 8 * p_out) / 1e6)
    status, _, body = http(url + "&group_by=adapter", key=key)
    assert status == 200, body
    rows = {r["adapter"]: r["requests"] for r in body["data"]}
    assert rows[None] >= 1 and rows["a0"] >= 1 and rows["a1"] >= 1
