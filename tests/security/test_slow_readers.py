"""A client that stops reading its stream holds neither an admission slot nor its request.

The attack: a team opens streams with a tiny receive window and reads a byte now and then.
The gateway held the tier admission slot until the client had read the whole answer, and
nothing bounded how long a write to it could wait, so a few such clients took every slot
(`[tiers] max_inflight`) and every other team queued, then got 503s. Now a stream's rest is read
ahead of the client (bounded) and the slot is given back when the node is done; a client that
takes nothing for `[server] write_timeout_s` is cut and billed as a disconnect.

Real parts: one node process on the tiny model, a `duet gateway` process in front with one
admission slot, a raw socket with a 4 KiB receive buffer that never reads, the openai client.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, metric, tiny_model
from tests.procs import Proc, duet_node, running
from tests.wait import wait_for

#: the node (8 × 900 tokens with logprobs; over a minute on a loaded 2-core CPU) is done before
WRITE_TIMEOUT_S = 120
N, MAX_TOKENS = 8, 900
#: 8 × 900 chunks with 20 logprobs each: ~6 MB of SSE, more than the kernel's socket buffers
#: take (the send buffer grows to tcp_wmem's 4 MiB at most)
LOGPROBS = 20
#: read ahead enough for the whole answer (the default bound is for many clients at once)
READ_AHEAD = 64 * 2**20


@pytest.fixture(scope="module")
def cluster(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, Proc]]:
    """(the gateway, its one node)"""
    tmp = tmp_path_factory.mktemp("slow")
    # KV for 8 samples of 900 tokens at once (the tiny args' 256 blocks hold 4,096 tokens)
    args = ("--dtype", "float32", "--kv-blocks", "1024", "--max-model-len", "1024")
    node = duet_node("both", tiny_llama, tmp, *args)
    with running(node):
        gw = gateway_proc(
            tmp,
            {MODEL: tiny_model(tiny_llama, both=[node.url])},
            tiers={
                "max_inflight": 1,
                "interactive_max_wait_s": 3,
                "stream_read_ahead_bytes": READ_AHEAD,
            },
            server={"write_timeout_s": WRITE_TIMEOUT_S},
        )
        with running(gw):
            yield gw, node


def _stalled_stream(gw: Proc, key: str) -> socket.socket:
    """A streamed completion on a socket that never reads (its receive buffer: 4 KiB)."""
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "n": N,
            "max_tokens": MAX_TOKENS,
            "logprobs": LOGPROBS,
            "ignore_eos": True,
            "prompt": "talk",
        }
    ).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", gw.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    return s


def test_a_client_that_stops_reading_frees_the_slot_then_its_request(
    cluster: tuple[Proc, Proc],
) -> None:
    gw, node = cluster
    slow, other = make_team(gw.url, "slow"), make_team(gw.url, "other")
    made = metric(node.url, "duet:generation_tokens_total")
    s = _stalled_stream(gw, slow)
    try:
        # the node computes the whole answer while the client reads nothing …
        wait_for(
            lambda: metric(node.url, "duet:generation_tokens_total") >= made + N * MAX_TOKENS,
            WRITE_TIMEOUT_S,
            "the node to finish the stalled stream's answer",
        )
        # … and the one admission slot is free for another team at once (before: held until
        # the client read it all; the other team waited 3 s, then a 503)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=other, max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert r.choices[0].message.content is not None

        # the stalled client is cut after write_timeout_s and billed as a disconnect
        def record() -> list[dict]:
            status, _, body = http(f"{gw.url}/v1/usage?group_by=record", key=slow)
            assert status == 200, body
            return body["data"]

        recs = wait_for(record, WRITE_TIMEOUT_S + 60, "the stalled stream's usage record")
        assert [r["status"] for r in recs] == ["client_disconnected"], recs
        assert recs[0]["completion_tokens"] > 0, recs
    finally:
        s.close()
