"""A 3-member etcd behind one comma-separated URL (coordinator/etcd_store.py: every member,
round-robin), with members frozen by SIGSTOP — the grey failure: sockets open, nothing answers.

- One member frozen: a lease held through coordinator/lease.py keeps its key and its lease id
  the whole time (its refreshes that go to the frozen member fail alone, within their own
  deadline, and are tried again on the same lease). Before, one refresh past its 3 s deadline
  ended the session: the key vanished (its lease expired) and a new lease was granted, under an
  etcd that had its quorum all along — a node's registration dropped out of every router.
- Two frozen (the quorum lost): every call fails within its deadline, none hangs; continued,
  the same client works again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from coordinator.etcd_server import EtcdServer
from coordinator.etcd_store import EtcdStore
from coordinator.lease import LeaseHolder, Watcher
from coordinator.store import StoreError
from tests.procs import Proc, running

TTL = 3
KEY = "/duet/test/members/holder"


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    tmp = tmp_path_factory.mktemp("etcd-members")
    servers = [EtcdServer(tmp / f"m{i}") for i in range(3)]
    procs = []
    for i, s in enumerate(servers):
        p = Proc(s.command(f"etcd-{i}", servers), s.port, tmp / f"etcd-{i}.log")
        p.url = s.url
        procs.append(p)
    with running(*procs, timeout=60):
        yield procs


def _url(procs: list[Proc]) -> str:
    return ",".join(p.url for p in procs)


class KeyHolder(LeaseHolder):
    async def attach(self) -> list[Watcher]:
        await self.store.put(KEY, b"here", self.lease)
        return []


def test_a_frozen_member_costs_no_lease_and_no_key(members: list[Proc]) -> None:
    async def scenario() -> tuple[list[str], set[int]]:
        store = EtcdStore(_url(members), timeout=TTL)
        healthy = EtcdStore(_url(members[:2]), timeout=TTL)
        holder = KeyHolder(store, TTL, "test holder")
        task = asyncio.create_task(holder.run())
        events: list[str] = []
        try:
            start_by = time.monotonic() + 30
            while await healthy.get(KEY) is None:
                assert time.monotonic() < start_by, "the holder never wrote its key"
                await asyncio.sleep(0.1)
            rev = (await healthy.get(KEY)).mod_revision  # type: ignore[union-attr]

            async def watch() -> None:
                async for ev in healthy.watch_prefix(KEY, rev + 1):
                    events.append(ev.kind)

            watcher = asyncio.create_task(watch())
            leases = {holder.lease}
            os.kill(members[2].proc.pid, signal.SIGSTOP)
            try:
                end = time.monotonic() + 4 * TTL  # the fault's length: four lease lives
                while time.monotonic() < end:
                    leases.add(holder.lease)
                    await asyncio.sleep(0.2)
            finally:
                os.kill(members[2].proc.pid, signal.SIGCONT)
            assert await healthy.get(KEY) is not None
            watcher.cancel()
            return events, leases
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await holder.release()
            await store.close()
            await healthy.close()

    events, leases = asyncio.run(scenario())
    assert "delete" not in events, f"the key was deleted while etcd kept its quorum: {events}"
    assert len(leases) == 1, f"the lease was given up and granted again: {leases}"


def test_the_quorum_lost_fails_every_call_within_its_deadline(members: list[Proc]) -> None:
    async def scenario() -> None:
        store = EtcdStore(_url(members), timeout=2.0)
        try:
            await store.put("/duet/test/members/q", b"1")
            for p in members[:2]:
                os.kill(p.proc.pid, signal.SIGSTOP)
            try:
                for _ in range(3):
                    t0 = time.monotonic()
                    with pytest.raises(StoreError):
                        await store.put("/duet/test/members/q", b"2")
                    assert time.monotonic() - t0 < 2.0 + 1.5, "a call outlived its deadline"
            finally:
                for p in members[:2]:
                    os.kill(p.proc.pid, signal.SIGCONT)
            # (a failed write is indeterminate: a proposal queued meanwhile may still commit)
            end = time.monotonic() + 30
            while True:
                try:
                    await store.put("/duet/test/members/back", b"3")
                    break
                except StoreError:
                    assert time.monotonic() < end, "etcd did not come back"
                    await asyncio.sleep(0.2)
            kv = await store.get("/duet/test/members/back")
            assert kv is not None and kv.value == b"3"
        finally:
            await store.close()

    asyncio.run(scenario())
