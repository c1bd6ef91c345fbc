"""node/busy_window.py on its own clock: the busy fraction over the recent window, None until
the samples span enough time, a restarted engine's counter starting over, clamped to 0..1."""

from __future__ import annotations

import pytest

from node.busy_window import BusyWindow


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_fraction_is_the_busy_seconds_over_the_time_they_span() -> None:
    clock = Clock()
    w = BusyWindow(window_s=30.0, min_span_s=2.0, clock=clock)
    assert w.observe(0.0) is None  # one sample: no span
    clock.t += 1.0
    assert w.observe(0.5) is None  # 1 s: too short to say anything
    clock.t += 3.0
    assert w.observe(2.0) == pytest.approx(0.5)  # 2 busy seconds in 4


def test_only_the_last_window_counts() -> None:
    clock = Clock()
    w = BusyWindow(window_s=30.0, clock=clock)
    busy = 0.0
    for _ in range(60):  # 60 s fully busy, one frame a second
        w.observe(busy)
        clock.t += 1.0
        busy += 1.0
    assert w.observe(busy) == pytest.approx(1.0)
    for _ in range(40):  # then 40 s idle: the busy minute has left the window
        clock.t += 1.0
        w.observe(busy)
    assert w.observe(busy) == pytest.approx(0.0)
    for _ in range(15):  # 15 s at half: half of the last 30 s were at half load
        clock.t += 1.0
        busy += 0.5
        last = w.observe(busy)
    assert last == pytest.approx(0.25, abs=0.02)


def test_a_counter_that_goes_back_starts_over() -> None:
    clock = Clock()
    w = BusyWindow(clock=clock)
    w.observe(500.0)
    clock.t += 10.0
    assert w.observe(3.0) is None  # the engine restarted: no fraction from across the restart
    clock.t += 10.0
    assert w.observe(8.0) == pytest.approx(0.5)


def test_the_fraction_stays_within_0_and_1() -> None:
    clock = Clock()
    w = BusyWindow(min_span_s=1.0, clock=clock)
    w.observe(0.0)
    clock.t += 2.0
    assert w.observe(5.0) == 1.0  # the step in flight at the first sample ended inside the span
