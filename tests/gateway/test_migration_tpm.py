"""A request whose stream migrates counts once in its team's tokens-per-minute window.

A decode node SIGKILLed mid-stream (tests/gateway/faults.py's relay), the stream continued on
another node (stream migration), then a second request of the same team: its
`x-ratelimit-remaining-tokens` says what the window holds, which must be the first request's
prompt and completion tokens once — what its usage record bills — not its prompt again for
the migrated leg. (The window takes the settled record's tokens, and a migrated leg's node
reports the original prompt only: node/responder.py's `resumed`. A guard: it held on main.)

Real parts: two decode node processes on the tiny model (and a prefill node under P/D), a
`duet gateway` process, the official openai client.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.gateway.faults import KillRelay
from tests.gateway.helpers import MODEL, make_team
from tests.gateway.test_failures import _node
from tests.gateway.test_migration import PROMPT, ask, check_record, gateway, kill_after, one_record
from tests.procs import running

TPM = 1_000_000


@pytest.mark.parametrize(
    ("pd", "stream"), [(False, True), (True, False)], ids=["streamed-prefill-on-d", "whole-p-d"]
)
async def test_a_migrated_request_counts_once_in_the_tpm_window(
    tmp_path: Path, tiny_llama: Path, relays: list[KillRelay], pd: bool, stream: bool
) -> None:
    roles = ("prefill", "decode", "decode") if pd else ("decode", "decode")
    nodes = [_node(role, tiny_llama, tmp_path) for role in roles]
    with running(*nodes):
        *p, d1, d2 = nodes
        r = await kill_after(relays, d1, chunks=7)
        static = {"prefill": [p[0].url]} if p else {}
        g = gateway(tmp_path, tiny_llama, decode=[r.url, d2.url], **static)
        with running(g):
            key = make_team(g.url, "m", tpm=TPM)
            await ask(g, key, stream)
            assert r.killed
            row = await one_record(g, key)
            legs = [p[0].url, r.url, p[0].url, d2.url] if p else [r.url, d2.url]
            check_record(row, legs, tiny_llama)  # one migration, billed once

            # the next request books its prompt and max_tokens; the rest of the window is the
            # migrated request's own
            # (asynchronously: the fault relay runs on this event loop)
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    g.url + "/v1/completions",
                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1},
                    headers={"Authorization": f"Bearer {key}"},
                ) as resp,
            ):
                body = await resp.json()
                assert resp.status == 200, body
                remaining = int(resp.headers["x-ratelimit-remaining-tokens"])
            window = TPM - remaining - (body["usage"]["prompt_tokens"] + 1)
            assert window == row["prompt_tokens"] + row["completion_tokens"], (window, row)
