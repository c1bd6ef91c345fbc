"""A cancelled etcd call is cancelled: `EtcdStore` bounds every RPC with a deadline, and the
task that waits on one must still stop when it is cancelled — a lease loop (coordinator/lease.py)
is stopped that way at shutdown and when a test ends.

On Python 3.11, `asyncio.wait_for` returns the result instead of raising CancelledError when the
call completes in the same loop turn as the cancel: the cancel is lost, and a `LeaseHolder.run`
cancelled there went on refreshing its lease for ever while its owner waited for it to stop (seen
in CI: tests/coordinator/test_etcd_members.py hung until pytest's 600 s timeout). The race is
made here on purpose: the call's result and the cancel land in one turn.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.etcd_store import EtcdStore


def test_a_call_cancelled_as_it_completes_raises_cancelled() -> None:
    async def scenario() -> None:
        # The channel connects lazily: nothing listens on this port and nothing dials it.
        store = EtcdStore("http://127.0.0.1:9", timeout=5.0)
        try:
            loop = asyncio.get_running_loop()
            answer: asyncio.Future[int] = loop.create_future()
            call = asyncio.create_task(store._call(answer))
            for _ in range(3):  # let the call start waiting on its answer
                await asyncio.sleep(0)
            answer.set_result(1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        finally:
            await store.close()

    asyncio.run(scenario())
