"""`duet up --autoscale`: the control endpoint through which the planner (in the supervised
coordinator, `--actuator local`) adds and removes node processes (planner/local.py has the wire).

Bounds: at most `max_nodes` nodes under supervision (default: the machine's CPUs, one thread
each at least; an explicit larger value is allowed with a warning — nodes then share CPUs); the
planner gets min 1 / max (max_nodes − other pools) per pool and `max_nodes` as its budget, so
both sides refuse past the limit. A new node copies the layout's group of its role, model and
pool (unpinned: autoscaled nodes come and go). Stopping is the last step of a drain-safe scale-in:
the planner has drained the node already; here it is SIGTERMed, waited for and taken off
supervision (never restarted).

The endpoint listens on loopback only, on a free port, and only `duet up`'s own coordinator is
told its URL. Until the supervisor is ready (every stage up) it answers 503 `starting`, and
`GET /ready` says so: the planner asks it before deciding anything (the coordinator runs, and
the planner with it, long before the gateway is up on a loaded machine).

Every change goes through the supervision thread (`Supervisor.call`), which may be slow to take
it (a tick stuck on a health check or a child's exit). The endpoint waits `call_timeout` (10 s)
for it, and its answer never says "failed" while the change can still happen: on the timeout
the queued call is cancelled — atomically, so it either never runs, and then the answer is 503
`busy`, or the supervision thread has taken it, and then the endpoint waits for it (a taken
call is quick: a SIGTERM, a Popen) and answers as usual. This matters for the stop: the local
actuator takes any non-200 stop as failed and undoes its drain (planner/local.py); a 503 for a
stop that the supervisor would still carry out would put the node back into routing just
before it is SIGTERMed, under traffic. A stop is one call (look up, check, retire), so the stop
either happened whole or not at all.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import msgspec

from planner.local import ControlError, ControlReady, NodeStarted, NodeStopped, ScaleOut
from runtime.cluster_secret import ClusterSecret

T = TypeVar("T")


def planner_toml(roles: list[str], max_nodes: int, extra_pools: int = 0) -> str:
    """The planner config `duet up --autoscale` hands its coordinator: min 1 / max per role."""
    per_role = max(1, max_nodes - (len(roles) - 1) - extra_pools)
    lines = [
        "# written by `duet up --autoscale` on every start",
        "[planner]",
        'mode = "load"',
        f"node_budget = {max_nodes}",
        "[planner.bounds]",
    ]
    lines += [f'"{r}" = [1, {per_role}]' for r in sorted(set(roles))]
    return "\n".join(lines) + "\n"


class SupervisorBusy(Exception):
    """The supervision thread did not take a call within `call_timeout`, and the call was
    cancelled: it never runs (the endpoint's 503 `busy`, after which nothing changes)."""


class Autoscale:
    """Starts and stops autoscaled nodes on the supervisor (`sup` is set once it exists)."""

    def __init__(
        self,
        cfg: Any,
        home: Any,
        etcd_url: str,
        max_nodes: int,
        threads: int,
        stage: int,
        served: dict[str, str],
        call_timeout: float = 10.0,
    ) -> None:
        self.cfg, self.home, self.etcd_url, self.served = cfg, home, etcd_url, served
        self.max_nodes, self.threads, self.stage = max_nodes, threads, stage
        #: how long a request waits for the supervision thread to take its call before it is
        #: cancelled (well under the local actuator's own timeouts: 60 s start, 120 s stop)
        self.call_timeout = call_timeout
        self.sup: Any = None
        self._lock = threading.Lock()
        self._serial = sum(g.count for g in cfg.nodes)

    def _nodes(self) -> list[Any]:
        return [c for c in self.sup.stages[self.stage] if not c.retiring]

    def _on_supervisor(self, fn: Callable[[], T], what: str) -> T:
        """`fn()` run on the supervision thread. SupervisorBusy only when it never runs: on the
        timeout the call is cancelled, and `cancel()` fails exactly when the thread has taken
        it (Future's state changes under its lock), so a call cannot run after a 503."""
        fut = self.sup.call(fn)
        try:
            return fut.result(self.call_timeout)
        except FutureTimeout:
            if fut.cancel():
                raise SupervisorBusy(what) from None
        # taken late, but taken: it is carried out, so the answer must say so, not "busy"
        self.sup.say(
            f"{what}: the supervisor took it after more than {self.call_timeout:g} s; waiting for "
            "it"
        )
        return fut.result()

    def start(self, req: ScaleOut) -> tuple[int, msgspec.Struct]:
        from duet.cmd_up import node_child

        groups = [
            g
            for g in self.cfg.nodes
            if g.role == req.role
            and self.served.get(g.model or self.cfg.model, g.model or self.cfg.model) == req.model
        ]
        groups = [g for g in groups if g.pool == req.pool] or groups
        if not groups:
            return 404, ControlError(
                message=f"no {req.role} node of {req.model} (pool {req.pool}) in this layout",
                code="no_such_pool",
            )
        with self._lock:
            live = len(self._on_supervisor(self._nodes, f"count nodes for a new {req.role} node"))
            if live >= self.max_nodes:
                return 409, ControlError(
                    message=f"{live} nodes running: --max-nodes {self.max_nodes} reached",
                    code="max_nodes",
                )
            self._serial += 1
            name = f"{req.role}-{self._serial}"
            child = node_child(self.cfg, self.home, self.etcd_url, groups[0], name, self.threads)
            self._on_supervisor(lambda: self.sup.add(self.stage, child), f"start {name}")
        url = (child.health_url or "").removesuffix("/health")
        return 200, NodeStarted(name=name, node_id=name, url=url, nodes=live + 1)

    def stop(self, node_id: str, dry_run: bool = False) -> tuple[int, msgspec.Struct]:
        """Stop a (drained) node; `dry_run`: only say whether it would be stopped, so the
        actuator asks before it drains a node it could then not remove. A 503 `busy` (raised
        as SupervisorBusy) means the node is not stopped and will not be: the actuator may
        undo its drain."""

        def look_and_retire() -> tuple[int, msgspec.Struct, Any]:
            # one supervision call: the node found, the last-node check and the retire happen
            # together, or (cancelled) none of them
            nodes = self._nodes()
            child = next((c for c in nodes if c.name == node_id), None)
            if child is None:
                return (
                    404,
                    ControlError(
                        message=f"no node {node_id!r} under supervision", code="node_not_found"
                    ),
                    None,
                )
            if len(nodes) <= 1:
                return (
                    409,
                    ControlError(message="the last node is not stopped", code="last_node"),
                    None,
                )
            if dry_run:
                return 200, NodeStopped(node_id=node_id, exit_code=None, nodes=len(nodes)), None
            self.sup.retire(child)
            return 200, NodeStopped(node_id=node_id, exit_code=None, nodes=len(nodes) - 1), child

        with self._lock:
            status, body, child = self._on_supervisor(look_and_retire, f"stop {node_id}")
        if child is None:
            return status, body
        # SIGTERMed: from here the node refuses an undo of its drain (409 node_stopping), so
        # even an actuator that gives up on this answer cannot put it back into routing
        child.retired.wait(self.sup.stop_timeout + 15)
        code = None if child.proc is None else child.proc.returncode
        assert isinstance(body, NodeStopped)
        return 200, NodeStopped(node_id=node_id, exit_code=code, nodes=body.nodes)


def serve_control(auto: Autoscale, secret: ClusterSecret) -> ThreadingHTTPServer:
    """The control endpoint on 127.0.0.1 (a free port), served by a daemon thread. It starts
    and stops nodes, so it needs the cluster secret as the rest of the internal plane does
    (any local user could reach a loopback port); the planner's local actuator sends it."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet: the supervisor says what happens
            pass

        def _send(self, status: int, body: msgspec.Struct) -> None:
            raw = msgspec.json.encode(body)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _authorized(self) -> bool:
            if secret.verify(self.headers.get("Authorization")):
                return True
            self._send(
                401,
                ControlError(
                    message="duet up's control endpoint needs the cluster secret "
                    "('Authorization: Bearer <secret>')",
                    code="cluster_secret_required",
                ),
            )
            return False

        def _starting(self) -> bool:
            if auto.sup is not None and auto.sup.ready.is_set():
                return False
            self._send(503, ControlError(message="duet up is still starting", code="starting"))
            return True

        def do_GET(self) -> None:
            # `GET /ready`: the local actuator asks before its planner decides anything (a step
            # decided while duet up still starts could only fail: 503 `starting`)
            if not self._authorized():
                return
            if self.path.partition("?")[0].strip("/") != "ready":
                self._send(404, ControlError(message=f"no route {self.path}", code="not_found"))
            elif not self._starting():
                self._send(200, ControlReady(max_nodes=auto.max_nodes))

        def do_POST(self) -> None:
            if not self._authorized():
                return
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path, _, query = self.path.partition("?")
            parts = path.strip("/").split("/")
            try:
                if self._starting():
                    pass
                elif parts == ["nodes"]:
                    self._send(*auto.start(msgspec.json.decode(raw, type=ScaleOut)))
                elif len(parts) == 3 and parts[0] == "nodes" and parts[2] == "stop":
                    self._send(*auto.stop(parts[1], dry_run=query == "dry_run=1"))
                else:
                    self._send(404, ControlError(message=f"no route {self.path}", code="not_found"))
            except (msgspec.DecodeError, msgspec.ValidationError, json.JSONDecodeError) as e:
                self._send(400, ControlError(message=f"bad request: {e}", code="bad_request"))
            except SupervisorBusy as e:  # cancelled: nothing was done, nothing will be
                self._send(
                    503,
                    ControlError(
                        message=f"the supervisor is busy (starting or stopping): {e} was not "
                        f"taken within {auto.call_timeout:g} s and is called off",
                        code="busy",
                    ),
                )

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="duet-up-control", daemon=True).start()
    return server
