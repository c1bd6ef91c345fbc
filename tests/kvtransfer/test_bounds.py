"""Transport state stays bounded and a failed read tells whether it may still write: the
notification queue drops its oldest messages past its bound, at most
MAX_PEERS peers stay connected (least recently used dropped), peer locks live only while a
connection is set up, and a backend's late write surfaces as the TransferError's `settled`."""

from __future__ import annotations

import asyncio

import pytest

import kvtransfer.base as base
from kvtransfer import PeerError, make_transport
from kvtransfer.metadata import Notification
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool


async def test_notification_queue_is_bounded() -> None:
    async with make_transport("tcp", engine_id="D") as t:
        for i in range(base.MAX_QUEUED_NOTIFICATIONS + 10):
            t._deliver(Notification(engine_id="P", message=str(i).encode()))
        got = t.drain_notifications()
    assert len(got) == base.MAX_QUEUED_NOTIFICATIONS and t.notifications_dropped == 10
    assert (
        got[0].message == b"10"
        and got[-1].message == str(base.MAX_QUEUED_NOTIFICATIONS + 9).encode()
    )


async def test_peers_are_lru_bounded_and_locks_do_not_accumulate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(base, "MAX_PEERS", 2)
    owners = [make_transport("tcp", engine_id=f"P{i}") for i in range(3)]
    pools = [HostPool(TEST_LAYOUT, i) for i in range(4)]
    async with make_transport("tcp", engine_id="D") as reader:
        try:
            await reader.register_pool(pools[3].base, TEST_LAYOUT)
            peers = []
            for o, pool in zip(owners, pools, strict=False):
                await o.register_pool(pool.base, TEST_LAYOUT)
                peers.append(await reader.add_peer(o.metadata()))
            assert set(reader.peers) == {"P1", "P2"} and not peers[0].alive
            assert reader._peer_locks == {}
            await reader.read(peers[2], [1], [1])  # the kept ones still work
        finally:
            for o in owners:
                await o.close()


async def test_a_late_write_surfaces_as_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    owner_pool, reader_pool = HostPool(TEST_LAYOUT, 1), HostPool(TEST_LAYOUT, 2)
    async with (
        make_transport("tcp", engine_id="P") as owner,
        make_transport("tcp", engine_id="D") as reader,
    ):
        await owner.register_pool(owner_pool.base, TEST_LAYOUT)
        await reader.register_pool(reader_pool.base, TEST_LAYOUT)
        peer = await reader.add_peer(owner.metadata())
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def stuck_read(p, plan, landed):  # a backend that gave up but cannot stop the copy
            reader._late_write(plan, done)
            raise PeerError("injected: the copy could not be cancelled")

        monkeypatch.setattr(reader, "_read", stuck_read)
        with pytest.raises(PeerError) as info:
            await reader.read(peer, [1, 2], [3, 4])
        assert info.value.settled is done  # type: ignore[attr-defined]
        assert reader._late_writes == {}
        monkeypatch.undo()
        peer = await reader.add_peer(owner.metadata())  # the failure dropped it
        await reader.read(peer, [1, 2], [3, 4])  # a read that ends cleanly leaves nothing behind
        assert reader._late_writes == {}
