"""A capacity outage is a 503, not a 404: when every node of a model the gateway serves is gone
for a while (dead, drained, its registration expired), the client gets 503 `no_capacity` with a
Retry-After — the model exists, its nodes are momentarily gone. Real etcd (the gateway's view),
a real decode node, a real gateway, the official openai client."""

from __future__ import annotations

from pathlib import Path

import aetcd
import openai

from coordinator.etcd_server import EtcdServer
from protocol.cluster import node_key
from tests.gateway.helpers import MODEL, gateway_proc, make_team, tiny_model
from tests.gateway.test_etcd_view import info
from tests.gateway.test_failures import _node
from tests.procs import running
from tests.wait import until


async def _ask(c: openai.AsyncOpenAI) -> openai.APIStatusError | None:
    """None when served, else the error."""
    try:
        await c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    except openai.APIStatusError as e:
        return e
    return None


async def _served(c: openai.AsyncOpenAI) -> bool:
    return await _ask(c) is None


async def test_no_node_left_is_503_no_capacity_not_404(
    etcd: EtcdServer, tiny_llama: Path, tmp_path: Path
) -> None:
    d = _node("decode", tiny_llama, tmp_path)
    key_d = node_key("default", "decode", "d1").encode()
    model = {k: v for k, v in tiny_model(tiny_llama).items() if k != "static"}
    g = gateway_proc(tmp_path, {MODEL: model}, routing={"etcd": etcd.url})
    async with aetcd.Client(host="127.0.0.1", port=etcd.port) as client:
        await client.put(key_d, info(d, "decode", "d1"))
        with running(d, g):
            c = openai.AsyncOpenAI(
                base_url=g.url + "/v1", api_key=make_team(g.url, "o"), max_retries=0
            )
            await until(lambda: _served(c), what="an answer from d1")
            # d1's registration expires (it died, or drains): the model has no node for a while
            await client.delete(key_d)
            err = await until(lambda: _ask(c), what="the gateway to see d1 gone")
            assert err.status_code == 503, (err.status_code, err.message)
            assert err.body["code"] == "no_capacity", err.body
            assert int(err.response.headers["Retry-After"]) >= 1
            assert MODEL in err.message
            # its node comes back: served again, without a restart
            await client.put(key_d, info(d, "decode", "d1"))
            await until(lambda: _served(c), what="d1 back in the view")
