"""A simulated node's KV events reach the coordinator when the real node's poller would carry
them (sim/event_poll.py): at the end of a step a poll waited for, else at the next poll on the
0.1 s grid — checked on exact virtual times, alone and inside a SimNode."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from engine.request import Request, SamplingParams
from sim import vclock
from sim.event_poll import EventPoll
from sim.node import SimNode
from tests.sim.helpers import toy_profile


def _flushes(script: list[tuple[str, float, float]]) -> list[float]:
    """Run `script` — ("step", start, seconds) or ("idle", at, 0) events made between steps —
    against one EventPoll; the virtual times at which it flushed events."""
    out: list[float] = []
    pending = [False]

    def flush() -> None:
        if pending[0]:
            out.append(asyncio.get_running_loop().time())
            pending[0] = False

    async def main() -> None:
        loop = asyncio.get_running_loop()
        poll = EventPoll(flush, lambda: pending[0])
        for kind, at, seconds in script:
            await asyncio.sleep(at - loop.time())
            if kind == "idle":
                pending[0] = True
                poll.events_made(loop.time())
                continue
            poll.step_started(loop.time())
            await asyncio.sleep(seconds)
            pending[0] = True
            poll.step_ended(loop.time())
        await asyncio.sleep(1.0)  # every timer set has run by then

    vclock.run(main())
    return out


def test_a_long_step_publishes_at_its_end() -> None:
    # the poll issued at 0.1 waits for the step (the engine answers between steps)
    assert _flushes([("step", 0.0, 0.5)]) == [pytest.approx(0.5)]


def test_a_short_step_publishes_at_the_next_poll() -> None:
    # the grid starts at 0: the step ends at 0.02, the next poll is at 0.1
    assert _flushes([("step", 0.0, 0.02)]) == [pytest.approx(0.1)]
    # after a poll that waited for a step (0.5), the grid is re-anchored there: 0.6, not 0.5 + ...
    assert _flushes([("step", 0.0, 0.5), ("step", 0.5, 0.02)]) == [
        pytest.approx(0.5),
        pytest.approx(0.6),
    ]


def test_a_poll_that_falls_in_a_step_waits_for_its_end() -> None:
    # events from the step ending 0.05; the poll at 0.1 falls inside the next step (0.08-0.2)
    assert _flushes([("step", 0.0, 0.05), ("step", 0.08, 0.12)]) == [pytest.approx(0.2)]


def test_events_made_while_idle_go_at_the_next_poll_on_the_grid() -> None:
    assert _flushes([("idle", 1.234, 0.0)]) == [pytest.approx(1.3)]


def test_a_step_without_a_timer_still_reanchors_the_grid() -> None:
    # the poller polled at 0.1 during the step (no timer: nothing was waiting then) and answered
    # at its end, 0.25: the grid is now 0.35, 0.45 ... (the old one would have said 0.4)
    assert _flushes([("step", 0.0, 0.25), ("idle", 0.31, 0.0)]) == [
        pytest.approx(0.25),
        pytest.approx(0.35),
    ]


def test_a_simulated_nodes_blocks_reach_the_index_at_the_poll_not_at_the_step() -> None:
    """A colocated toy node: the prompt's step ends at ~0.014 s, but its BlockStored goes out
    with the poll at 0.1 (or the end of the decode step in flight then), as a real node's does."""
    prof = toy_profile()
    seen: list[tuple[float, int]] = []
    step_ends: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def on_events(node_id: str, events: list) -> None:
            seen.append((loop.time(), len(events)))

        node = SimNode(
            "n0",
            "both",
            prof.step,
            num_blocks=64,
            block_size=16,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            on_events=on_events,
        )
        run = loop.create_task(node.run())
        done = node.add(
            Request("r0", list(range(2, 42)), SamplingParams(max_tokens=30, ignore_eos=True)),
            lambda req, now: step_ends.append(now),
        )
        await done
        await asyncio.sleep(0.5)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)

    vclock.run(main())
    first_step_end = step_ends[0]  # the prompt's step samples the first token at its end
    assert first_step_end < 0.05
    assert seen, "the node's prompt blocks never reached the index"
    t, _ = seen[0]
    assert t > first_step_end + 0.05  # not at the step's end (what the simulator did before)
    assert 0.1 - 1e-9 <= t <= 0.1 + max(b - a for a, b in itertools.pairwise(step_ends)) + 1e-9
