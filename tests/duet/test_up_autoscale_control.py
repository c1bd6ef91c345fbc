"""`duet up --autoscale`'s control endpoint (duet/up_autoscale.py) when the supervision thread is
slow to take a stop: the answer is never "failed" while the stop can still happen.

The real endpoint (HTTP, the cluster secret), the real Autoscale and a real Supervisor with two
plain processes as its nodes; the test plays the supervision thread (`supervise_once`, the body
of `Supervisor.run`'s loop: `run` needs the main thread for its signal handlers), so it decides
when the thread is free. The endpoint's wait for the thread is short here (`call_timeout`).

- Not taken at all within the wait: 503 `busy`, and once the thread is free again the node is
  not stopped — the local actuator, which undoes its drain on that 503, is right to.
- Taken, but not finished within the wait (the thread is stuck in the retire, after its SIGTERM,
  on a blocked stderr): the answer waits and is 200 NodeStopped — the old code answered 503
  here, and the actuator put back into routing a node that was being stopped.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pytest

from duet.supervisor import Child, Supervisor
from duet.up_autoscale import Autoscale, serve_control
from duet.up_config import UpConfig, layout_from_flags
from runtime.cluster_secret import ClusterSecret

SECRET = ClusterSecret(secrets.token_urlsafe(32), "test")
#: the endpoint's wait for the supervision thread (10 s in `duet up`)
CALL_TIMEOUT_S = 0.2
#: bounds on waiting for something that must happen (not timing assumptions)
WAIT_S = 30.0


class StderrBlockingSupervisor(Supervisor):
    """A real Supervisor whose stderr blocks while it says that it stops a node (a full pipe),
    once `block_retire` is set: its thread is then stuck inside the retire, after the SIGTERM,
    until `unblock` is set. Meanwhile its `call` hands the future back only once the thread has
    taken the call (done, or stuck in it), so the endpoint's wait starts with the stop under
    way and runs out before it is finished: the race at the end of the wait, made certain.
    Every line it says is kept in `lines`; `changed` is notified on each."""

    def __init__(self, stages: list[list[Child]]) -> None:
        super().__init__(stages, tail=False, stop_timeout=WAIT_S)
        self.block_retire = threading.Event()
        self.unblock = threading.Event()
        self.stuck = False
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def say(self, msg: str) -> None:
        if (
            self.block_retire.is_set()
            and msg.startswith("stopping ")
            and msg.endswith("(scale-in)")
        ):
            with self.changed:
                self.stuck = True
                self.changed.notify_all()
            assert self.unblock.wait(WAIT_S), "the test never unblocked the supervisor's stderr"
        with self.changed:
            self.lines.append(msg)
            self.changed.notify_all()

    def call(self, fn: Callable[[], object]) -> Future[object]:
        fut = super().call(fn)
        if self.block_retire.is_set():
            fut.add_done_callback(lambda _: self._notify())
            with self.changed:
                assert self.changed.wait_for(lambda: fut.done() or self.stuck, WAIT_S), (
                    "the call was never taken"
                )
        return fut


@dataclass
class UpStandIn:
    """What `duet up --autoscale` runs: the supervisor with two nodes, Autoscale, the endpoint."""

    sup: StderrBlockingSupervisor
    auto: Autoscale
    nodes: dict[str, Child]
    url: str
    free: threading.Event  # set: the supervision thread runs (the test's stand-in for run's loop)

    def stop(self, node_id: str) -> tuple[int, dict]:
        req = urllib.request.Request(
            f"{self.url}/nodes/{node_id}/stop",
            data=b"{}",
            method="POST",
            headers={**SECRET.headers, "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=WAIT_S * 3) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture
def up(tmp_path: Path) -> Iterator[UpStandIn]:
    sup = StderrBlockingSupervisor([[]])
    nodes = {
        name: Child(
            name, [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / f"{name}.log"
        )
        for name in ("prefill-0", "decode-0")
    }
    for c in nodes.values():  # no supervision thread yet: the test's thread is it
        sup.add(0, c)
    sup.ready.set()
    cfg = UpConfig(nodes=layout_from_flags(1, 1, None))
    auto = Autoscale(
        cfg, tmp_path, "http://127.0.0.1:1", max_nodes=2, threads=1, stage=0, served={}
    )
    auto.call_timeout = CALL_TIMEOUT_S  # 10 s in duet up
    auto.sup = sup
    server = serve_control(auto, SECRET)
    free, done = threading.Event(), threading.Event()

    def supervision() -> None:
        while not done.is_set():
            if free.wait(0.05):
                sup.supervise_once()
                done.wait(0.05)  # the supervision interval (0.5 s in duet up)

    thread = threading.Thread(target=supervision, name="test-supervision", daemon=True)
    thread.start()
    try:
        yield UpStandIn(sup, auto, nodes, f"http://127.0.0.1:{server.server_address[1]}", free)
    finally:
        sup.unblock.set()
        done.set()
        thread.join(WAIT_S)
        server.shutdown()
        server.server_close()
        for c in nodes.values():
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
            if c.proc is not None:
                c.proc.wait()


def test_a_stop_the_supervisor_did_not_take_in_time_is_called_off(up: UpStandIn) -> None:
    d = up.nodes["decode-0"]
    status, body = up.stop("decode-0")  # the supervision thread is not free: nothing takes the call
    assert status == 503 and body["code"] == "busy", body
    assert "called off" in body["message"], body
    # the thread is free again and works off what was queued: the cancelled stop is not among it
    up.free.set()
    ran = threading.Event()
    up.sup.call(ran.set)  # queued after the stop: once it ran, the stop's turn has passed
    assert ran.wait(WAIT_S), "the supervision thread never took a call"
    assert not d.retiring and d.proc is not None and d.proc.poll() is None, (
        "a stop answered 503 stopped the node"
    )
    assert d in up.sup.stages[0] and not d.retired.is_set()
    assert not any(line.startswith("stopping decode-0") for line in up.sup.lines), up.sup.lines
    # and a stop the thread takes in time does stop it (the wait as long as the thread may need)
    up.auto.call_timeout = WAIT_S
    status, body = up.stop("decode-0")
    assert status == 200 and body["node_id"] == "decode-0" and body["nodes"] == 1, body
    assert d.retired.is_set() and d not in up.sup.stages[0] and d.proc.poll() is not None


def test_a_stop_the_supervisor_took_late_is_answered_as_done(up: UpStandIn) -> None:
    d = up.nodes["decode-0"]
    up.sup.block_retire.set()  # the thread will be stuck inside the retire, after the SIGTERM
    up.free.set()
    answer: list[tuple[int, dict]] = []

    def ask() -> None:
        got = up.stop("decode-0")
        with up.sup.changed:
            answer.append(got)
            up.sup.changed.notify_all()

    asker = threading.Thread(target=ask, name="test-actuator", daemon=True)
    asker.start()
    # the endpoint's wait ran out with the stop under way: it answered, or said that it waits
    # for the stop; only then is the supervisor's stderr let go
    with up.sup.changed:
        assert up.sup.changed.wait_for(
            lambda: answer or any("took it after more than" in line for line in up.sup.lines),
            WAIT_S * 3,
        ), "the endpoint neither answered nor waited for the stop"
    up.sup.unblock.set()
    asker.join(WAIT_S * 3)
    assert answer, "no answer from the control endpoint"
    status, body = answer[0]
    assert d.proc is not None and d.proc.wait(WAIT_S) is not None  # SIGTERMed: it stops either way
    assert status == 200, (
        f"the stop was carried out but answered {status} {body}: the actuator undoes the drain"
    )
    assert body == {"node_id": "decode-0", "exit_code": d.proc.returncode, "nodes": 1}, body
    assert d.retired.is_set() and d not in up.sup.stages[0]
