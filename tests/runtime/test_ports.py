"""free_port() gives ports no outgoing connection can take before a server binds them: outside
the kernel's ephemeral range (a node lost its port to one in CI), never the same one twice, and
not one another process was just handed (a test's `duet up` lost its port to another xdist
worker's server in CI)."""

from __future__ import annotations

import random
import socket
import subprocess
import sys

from runtime.ports import _ephemeral_range, free_port


def test_free_ports_are_outside_the_ephemeral_range_and_bindable() -> None:
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    for p in ports:
        assert not lo <= p <= hi, (p, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free, as promised


class _Draws(random.Random):
    """Draws `first` until it has been drawn `times` times, then at random."""

    def __init__(self, first: int, times: int) -> None:
        super().__init__()
        self.first, self.left = first, times

    def choice(self, seq):  # type: ignore[override]
        if self.left > 0:
            self.left -= 1
            return self.first
        return super().choice(seq)


def test_a_port_another_process_was_handed_is_not_handed_again() -> None:
    # another process is handed a port and has not bound it yet (it has exited: the port is free)
    other = int(
        subprocess.run(
            [sys.executable, "-c", "from runtime.ports import free_port; print(free_port())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", other))  # free now
    got = free_port(rng=_Draws(other, 3))  # this process draws that port first, three times
    assert got != other
