"""The NIXL transport's notification poller backs off when the transport is idle (an idle node
polled 500 times a second: ~6 % of a core each, on every node of a shared machine) and is
fast again as soon as a peer may need its progress: an agent call, a served `/kv/metadata`, a
prefill lease (`expect_reads`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import torch

import kvtransfer.nixl_transport as nt
from kvtransfer import make_transport, unavailable_reason
from runtime.strict import strict_mode
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool


@pytest.fixture
async def transport(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[nt.NixlTransport]:
    reason = unavailable_reason("nixl")
    if reason is not None:
        (pytest.fail if strict_mode() else pytest.skip)(f"nixl not usable here: {reason}")
    monkeypatch.setattr(nt, "BUSY_WINDOW_S", 0.3)
    t = make_transport("nixl", engine_id="poll-test")
    assert isinstance(t, nt.NixlTransport)
    await t.register_pool(torch.from_numpy(HostPool(TEST_LAYOUT, 1).bytes), TEST_LAYOUT)
    try:
        yield t
    finally:
        await t.close()


async def _polls_in(t: nt.NixlTransport, seconds: float) -> int:
    """How many times the poller called the agent in `seconds` (the agent is wrapped)."""
    calls = 0
    real = t._agent.get_new_notifs

    def counted() -> object:
        nonlocal calls
        calls += 1
        return real()

    t._agent.get_new_notifs = counted
    try:
        await asyncio.sleep(seconds)  # the poller runs on this loop meanwhile
    finally:
        t._agent.get_new_notifs = real
    return calls


async def _until_idle(t: nt.NixlTransport) -> None:
    while time.monotonic() < t._busy_until:
        await asyncio.sleep(0.05)
    await asyncio.sleep(
        0.5
    )  # the interval has doubled up to its cap by now (2 ms → 50 ms in 5 polls)


async def test_idle_poller_backs_off_and_wakes_on_metadata_and_leases(
    transport: nt.NixlTransport,
) -> None:
    await _until_idle(transport)
    idle = await _polls_in(transport, 1.0)
    assert idle <= 1.0 / 0.05 + 5, idle  # at most one poll per idle interval (was 2 ms: ~500)
    transport.metadata_bytes()  # GET /kv/metadata: a peer is about to connect
    busy = await _polls_in(transport, 0.25)
    assert busy >= 3 * idle / 4, (busy, idle)  # a quarter of the time, several times the polls
    await _until_idle(transport)
    transport.expect_reads(2.0)  # a prefill node's lease keeps it fast beyond the busy window
    await asyncio.sleep(1.0)
    assert time.monotonic() < transport._busy_until
    assert await _polls_in(transport, 0.25) >= 3 * idle / 4
