"""The virtual-time loop: sleeps and timeouts cost no wall time, order is kept, a stuck
simulation is an error rather than a hang."""

from __future__ import annotations

import asyncio
import time

import pytest

from sim import vclock


def test_an_hour_of_sleeps_takes_no_wall_time_and_keeps_order() -> None:
    seen: list[tuple[str, float]] = []

    async def sleeper(name: str, dt: float) -> None:
        await asyncio.sleep(dt)
        seen.append((name, asyncio.get_running_loop().time()))

    async def main() -> float:
        await asyncio.gather(sleeper("b", 3600.0), sleeper("a", 1.5), sleeper("c", 3600.25))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 10)
        return asyncio.get_running_loop().time()

    t0 = time.perf_counter()
    end = vclock.run(main())
    assert time.perf_counter() - t0 < 5
    assert [n for n, _ in seen] == ["a", "b", "c"]
    assert seen[0][1] == pytest.approx(1.5) and seen[2][1] == pytest.approx(3600.25)
    assert end == pytest.approx(3610.25)


def test_a_simulation_that_cannot_progress_raises() -> None:
    async def stuck() -> None:
        await asyncio.Event().wait()

    with pytest.raises(vclock.SimDeadlock):
        vclock.run(stuck())
