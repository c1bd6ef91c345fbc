"""The virtual actuator: it acts on nothing and only publishes the decision, for an external
scaler (KEDA's metrics-api or Prometheus scaler, a custom controller) to carry out.

Written on every step: a JSON file (atomically replaced) `{"pools": {"prefill/m/tier":
{"replicas": N, "at": unix time, "victim": node id or null}}}`, and the `duet:planner_*`
metrics the coordinator already serves. The external system drains through the node's
`POST /drain` (or the pod's preStop hook) before it removes a replica.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from planner.actuator import ActResult, Outcome, Victim
from planner.pools import PoolKey


class VirtualActuator:
    name = "virtual"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.pools: dict[str, dict[str, object]] = {}
        if self.path.exists():
            try:
                self.pools = json.loads(self.path.read_text()).get("pools", {})
            except (OSError, ValueError):
                self.pools = {}

    def _write(self, pool: PoolKey, to: int, victim: str | None) -> ActResult:
        self.pools[str(pool)] = {"replicas": to, "at": time.time(), "victim": victim}
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"pools": self.pools}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:
            return ActResult(Outcome.FAILED, f"cannot write {self.path}: {e}")
        return ActResult(Outcome.DONE, f"wrote {pool} = {to} to {self.path}", replicas=to)

    async def ready(self) -> str | None:
        return None  # nothing of its own to wait for

    async def scale_out(self, pool: PoolKey, to: int) -> ActResult:
        return self._write(pool, to, None)

    async def scale_in(self, pool: PoolKey, victim: Victim, to: int) -> ActResult:
        return self._write(pool, to, victim.node_id)

    async def close(self) -> None:
        return None
