"""A request whose own parameters make it fail costs one refusal, not a prefill per node.

The attack: `repetition_penalty: 1e-38` passed every check (only > 0 was asked), made the
penalised logits infinite and the first sample NaN after the whole prompt was computed; the node
answered 500 `request_failed`, which a router takes for a node failure and prefills again on
another node (3 prefills, 15 for a batch line, nothing billed). Now the penalty is bounded where
the node validates sampling parameters (protocol/sampling.py, protocol/openai.py), so the
request is refused before any prefill, and a failure that is the request's own (the sampler
cannot draw from its row) is answered as a 400 `invalid_request_error` that no router retries.

Real parts: one node process on the tiny model, read through its /metrics.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from node.responder import request_failed
from protocol.outputs import Fault, RequestOutput
from tests.procs import TINY_NODE_ARGS, Proc, duet_node, running

PROMPT = list(range(5, 205))  # 200 prompt tokens


@pytest.fixture(scope="module")
def node(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    n = duet_node("both", tiny_llama, tmp_path_factory.mktemp("faults"), *TINY_NODE_ARGS)
    with running(n):
        yield n


def _prompt_tokens(node: Proc) -> float:
    text = urllib.request.urlopen(node.url + "/metrics", timeout=5).read().decode()
    m = re.search(r"^duet:prompt_tokens(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert m, "duet:prompt_tokens not in /metrics"
    return float(m.group(1))


async def _complete(node: Proc, prompt: list[int], **fields: object) -> tuple[int, dict]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, **fields}
    async with aiohttp.ClientSession() as s, s.post(node.url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("penalty", [1e-38, 0.001, 1e6])
async def test_a_degenerate_repetition_penalty_is_refused_before_any_prefill(
    node: Proc, penalty: float
) -> None:
    before = _prompt_tokens(node)
    for stream in (False, True):
        status, body = await _complete(node, PROMPT, repetition_penalty=penalty, stream=stream)
        assert status == 400, body
        assert body["error"]["type"] == "invalid_request_error"
        assert "repetition_penalty" in body["error"]["message"]
    assert _prompt_tokens(node) == before  # no prefill ran


async def test_a_bounded_penalty_still_computes(node: Proc) -> None:
    before = _prompt_tokens(node)
    status, body = await _complete(node, [6, *PROMPT[1:]], repetition_penalty=0.01, seed=1)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4
    assert _prompt_tokens(node) == before + len(PROMPT)  # its prompt, computed once


def test_the_requests_own_failure_is_a_400_the_engines_a_500() -> None:
    """What the node answers for a request the engine failed: its own fault is the client's
    error (a router passes a 4xx on and does not compute it again), the engine's a 500."""
    own = request_failed(
        RequestOutput("r", [], "", True, "error", error="not finite", fault=Fault.REQUEST)
    )
    engine = request_failed(RequestOutput("r", [], "", True, "error", error="forward failed"))
    assert (own.status, own.body().error.type) == (400, "invalid_request_error")
    assert "not finite" in own.body().error.message
    assert engine.status == 500
