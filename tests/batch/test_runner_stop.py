"""A batch runner stops when it is stopped: `BatchRunner.stop()` cancels the runner's loop and
waits for it, and the gateway's shutdown waits on that.

On Python 3.11, `asyncio.wait_for` returns the awaited result instead of raising CancelledError
when the wait completes in the loop turn the cancel lands in: the cancel is lost. The loop's idle
wait was such a call, so a `wake()` (a batch created, a result recorded) in the turn of `stop()`
left the loop running for ever and `stop()` waiting on it. The race is made here on purpose: the
wake and the stop land in one turn.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.config import BatchConfig
from gateway.batch.runner import BatchRunner
from tests.wait import until


async def _never_called(*_: object, **__: object) -> object:
    raise AssertionError("no batch exists: the runner has nothing to execute")


async def test_stop_in_the_turn_of_a_wake_stops_the_loop(tmp_path: Path) -> None:
    store = SqliteBatchStore(tmp_path / "batch.sqlite3")
    # a long poll: the loop sits in its idle wait until woken
    runner = BatchRunner(store, _never_called, BatchConfig(data_dir=tmp_path, poll_s=60.0))
    await runner.start()
    await until(lambda: runner._wake._waiters, timeout=10, what="the loop's idle wait")
    runner.wake()
    stopping = asyncio.ensure_future(runner.stop())
    try:
        done, _ = await asyncio.wait({stopping}, timeout=10)
        assert done, "stop() still waits on the runner's loop: the cancel was lost"
        assert runner._loop_task is not None and runner._loop_task.cancelled()
    finally:
        assert runner._loop_task is not None
        runner._loop_task.cancel()  # where the cancel was lost, a second one ends the loop
        await stopping
        store.close()
