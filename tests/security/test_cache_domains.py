"""No team learns another team's prompts from the prefix cache.

The attack: `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens a node served
from its prefix cache. With unsalted block hashes, team B sends guesses of team A's prompt and
reads the answer off `cached_tokens`: the right guess comes back with every block cached, a
wrong one with none — an oracle on what another tenant sent.

Now block hashes are salted per cache domain (DESIGN §8: `h_{-1} = xxh3_64(seed, domain)`, the
domain being the team, or its `cache_group`): the gateway routes with salted hashes and sends
the domain to both legs as `cache_salt`, and the nodes' prefix caches never match across
domains. Team B's exact guess gets `cached_tokens: 0`, team A's repeat still hits its own
cache, and two teams in one `cache_group` share on purpose.

Real parts: etcd, a coordinator, a prefill and a decode node (tiny model), the gateway routing
through the coordinator, the official openai client.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from coordinator.etcd_server import EtcdServer
from protocol.block_hash import block_hashes, domain_root
from tests.gateway.helpers import gateway_proc, make_team
from tests.procs import Proc, duet_node, free_port, running
from tests.wait import wait_for
from text.tokenizer import Tokenizer

MODEL = "tiny"
NODE_ARGS = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")
#: every prompt here is disaggregated unless the decode node has it cached
LOCAL_PREFILL_TOKENS = 8
#: team A's secret: several full blocks
SECRET = (
    "Quarterly forecast, confidential: revenue grows 4.2 percent, margin holds at 31 percent. " * 4
)


@dataclass
class Tenants:
    coordinator: Proc
    gateway: Proc
    keys: dict[str, str]
    model_dir: Path

    def client(self, team: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.gateway.url + "/v1", api_key=self.keys[team], max_retries=0
        )

    def cached(self, team: str, prompt: str) -> tuple[int, int]:
        """(cached_tokens, prompt_tokens) of one greedy completion of `prompt` by `team`."""
        r = self.client(team).completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0, r.usage.prompt_tokens


def _ready(coordinator: Proc, ids: set[str]) -> None:
    def ready() -> bool:
        with urllib.request.urlopen(coordinator.url + "/cluster", timeout=5) as r:
            nodes = json.loads(r.read())["nodes"]
        return ids <= {n["node_id"] for n in nodes if n["ready"]}

    wait_for(ready, timeout=60, what=f"nodes {sorted(ids)} ready")


@pytest.fixture(scope="module")
def tenants(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    tmp = tmp_path_factory.mktemp("cache-domains")
    with EtcdServer(tmp / "etcd") as etcd:
        port = free_port()
        coord = Proc(
            [
                sys.executable,
                "-m",
                "duet",
                "coordinator",
                "--etcd",
                etcd.url,
                "--port",
                str(port),
                "--local-prefill-tokens",
                str(LOCAL_PREFILL_TOKENS),
            ],
            port,
            tmp / "coordinator.log",
        )
        p = duet_node(
            "prefill",
            str(tiny_llama),
            tmp,
            *NODE_ARGS,
            "--etcd",
            etcd.url,
            "--node-id",
            "prefill-0",
        )
        d = duet_node(
            "decode", str(tiny_llama), tmp, *NODE_ARGS, "--etcd", etcd.url, "--node-id", "decode-0"
        )
        model = {
            "kind": "cluster",
            "tokenizer": str(tiny_llama),
            "served_name": tiny_llama.name,
            "input_usd_per_mtok": 1.0,
            "output_usd_per_mtok": 2.0,
        }
        groups = {f"teams.{t}": {"cache_group": "shared-prompts"} for t in ("carol", "dave")}
        g = gateway_proc(tmp, {MODEL: model}, routing={"coordinator": [coord.url]}, **groups)
        with running(coord, p, d, g):
            _ready(coord, {"prefill-0", "decode-0"})
            keys = {t: make_team(g.url, t) for t in ("alice", "bob", "eve", "carol", "dave")}
            yield Tenants(coord, g, keys, tiny_llama)


def test_a_team_cannot_read_another_teams_prompt_off_cached_tokens(tenants: Tenants) -> None:
    first, n = tenants.cached("alice", SECRET)
    assert n >= 4 * 16 and first == 0
    # Guesses from other teams, the exact one included: nothing is cached for them. (One guess
    # per team: a team's second guess would hit the shared start of its own first one.)
    assert tenants.cached("bob", SECRET)[0] == 0
    assert tenants.cached("eve", SECRET.replace("4.2", "3.1"))[0] == 0
    # Team A's own repeat still hits its cache: the salt isolates, it does not disable.
    again, _ = tenants.cached("alice", SECRET)
    assert again >= 16 * (n // 16 - 1), (again, n)


def test_teams_of_one_cache_group_share_on_purpose(tenants: Tenants) -> None:
    system = (
        "You are the support assistant of the shared help desk. Answer briefly and politely. " * 4
    )
    first, n = tenants.cached("carol", system + "Carol asks: where is my parcel?")
    assert first == 0 and n >= 4 * 16
    shared, _ = tenants.cached("dave", system + "Dave asks: how do I reset my password?")
    assert shared >= 16 * 4, shared
    # A team outside the group does not see the group's prefixes.
    assert tenants.cached("alice", system + "Alice asks: what is the weather?")[0] == 0


def test_the_coordinator_index_holds_the_salted_hashes_the_gateway_routes_with(
    tenants: Tenants,
) -> None:
    """The nodes' KV events carry the same salted hashes as the gateway's route request, so
    routing still finds a team's own prefixes — and only in its own domain."""
    prompt = "Routing keeps each team's prefixes apart, and still finds them for the team. " * 4
    tenants.cached("alice", prompt)
    ids = Tokenizer(tenants.model_dir).encode(prompt)

    def cached_on_the_index(domain: str | None) -> int:
        hashes = block_hashes(ids, 16, parent=domain_root(domain))
        body = {
            "model": tenants.model_dir.name,
            "block_hashes": hashes,
            "num_prompt_tokens": len(ids),
            "max_tokens": 2,
        }
        req = urllib.request.Request(
            tenants.coordinator.url + "/route",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            route = json.loads(r.read())
        return max(
            route["decode"]["cached_tokens"], (route.get("prefill") or {}).get("cached_tokens", 0)
        )

    # the node's KV events reach the index asynchronously
    wait_for(
        lambda: cached_on_the_index("team:alice") >= 16 * 4,
        what="alice's blocks on the coordinator's index",
    )
    assert cached_on_the_index("team:bob") == 0
    assert cached_on_the_index(None) == 0


def test_a_client_cannot_choose_its_cache_domain(tenants: Tenants) -> None:
    """The domain is the gateway's to set: a `cache_salt` from the client (vLLM's public API
    takes one) would let team B name team A's domain."""
    with pytest.raises(openai.BadRequestError) as e:
        tenants.client("bob").completions.create(
            model=MODEL, prompt=SECRET, max_tokens=1, extra_body={"cache_salt": "team:alice"}
        )
    assert e.value.code == "unsupported_field"
