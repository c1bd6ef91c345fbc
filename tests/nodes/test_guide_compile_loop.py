"""A node checks a request's guide off its event loop: the grammar check of a leg's
`guide` runs on the node's GuideChecker (text/guide_compile.py), sized by
`--guide-compile-threads` / `--guide-compile-timeout-s`, so a guide that compiles for a second
does not stall the node's other requests and streams; one past the time limit is a 400
`guide_too_complex` naming `guide`, and its verdict is remembered.

Real node processes on the tiny model. The slow guide is the slowest shape the size bounds
admit (11 objects of 1,000 optional properties, ~1 s to compile on the 2-core dev machine:
tests/gateway/test_guide_compile_loop.py). Order, not duration, is what the tests assert: the
gauge `duet:guide_compiles_running` says a compile is running, and /health and a plain
completion answer (and /metrics still shows it running) before it ends. On the old node the
check ran on the event loop: nothing answered until the compile ended."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from node.config import NodeConfig
from tests.gateway.helpers import http, metric
from tests.gateway.test_guide_compile_loop import slow_schema
from tests.procs import TINY_NODE_ARGS, Proc, duet_node, running
from tests.wait import wait_for
from text.guide_check import canonical_schema

RUNNING = "duet:guide_compiles_running"
COMPILES = "duet:guide_compiles_total"
TIMEOUT_S = 0.2


@pytest.fixture(scope="module")
def nodes(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, Proc]]:
    """A node with room for the slow guide (60 s), and one whose limit it breaks (0.2 s); one
    compile thread each."""
    tmp = tmp_path_factory.mktemp("node-guides")
    roomy = duet_node(
        "both",
        tiny_llama,
        tmp,
        *TINY_NODE_ARGS,
        "--guide-compile-threads",
        "1",
        "--guide-compile-timeout-s",
        "60",
    )
    strict = duet_node(
        "both",
        tiny_llama,
        tmp,
        *TINY_NODE_ARGS,
        "--guide-compile-threads",
        "1",
        "--guide-compile-timeout-s",
        str(TIMEOUT_S),
    )
    with running(roomy, strict):
        yield roomy, strict


def complete(node: Proc, **over: Any) -> tuple[int, dict[str, str], Any]:
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, **over}
    return http(node.url + "/v1/completions", "POST", body, key=None)


def guide(schema: dict[str, Any]) -> dict[str, str]:
    return {"kind": "json_schema", "spec": canonical_schema(schema)}


def idle(node: Proc) -> None:
    """No compile is running (a timed-out one holds its thread until llguidance returns)."""
    wait_for(lambda: metric(node.url, RUNNING) == 0, 60, "the compile threads to be idle")


def test_a_node_answers_while_a_guide_compiles(nodes: tuple[Proc, Proc]) -> None:
    node = nodes[0]
    idle(node)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(complete, node, max_tokens=4, guide=guide(slow_schema()))
        wait_for(lambda: metric(node.url, RUNNING) >= 1, 60, "the slow guide's compile to start")
        health, _, _ = http(node.url + "/health", key=None)
        status, _, plain = complete(node)
        # the compile that was running before they were asked is running still: the node's
        # event loop answered while it compiled (on the old node even /metrics waited for it)
        still = metric(node.url, RUNNING)
        assert health == 200 and status == 200 and len(plain["choices"][0]["token_ids"]) == 2, plain
        assert still >= 1, "the compile ended before /health and the completion were answered"
        status, _, body = slow.result(timeout=120)
    # the slow guide is admitted: its request ran, masked, once its grammar compiled
    assert status == 200 and body["choices"][0]["text"].startswith("{"), body


def test_a_guide_past_the_nodes_time_limit_is_a_400_remembered(nodes: tuple[Proc, Proc]) -> None:
    node = nodes[1]
    idle(node)
    schema = slow_schema()
    status, _, body = complete(node, guide=guide(schema))
    assert status == 400, body
    err = body["error"]
    assert err["param"] == "guide" and err["code"] == "guide_too_complex", err
    assert f"too complex to compile within {TIMEOUT_S:g} s" in err["message"], err
    idle(node)
    n = metric(node.url, COMPILES)
    # resent: refused at once from the verdict cache, without a second compile
    status, _, body = complete(node, guide=guide(schema))
    assert status == 400 and body["error"]["code"] == "guide_too_complex", body
    assert metric(node.url, RUNNING) == 0 and metric(node.url, COMPILES) == n


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guide_compile_threads", 0),
        ("guide_compile_timeout_s", 0.0),
        ("guide_compile_timeout_s", 601.0),
    ],
)
def test_the_compile_bounds_are_checked(field: str, value: float) -> None:
    with pytest.raises(ValueError, match="guide compile"):
        NodeConfig(**{field: value})
