"""The simulator runs the real scheduler, block pool, routing policy and tier admission — not
copies. Each real method is wrapped with a counter before a small simulation runs: a copy
inside sim/ would leave its counter at zero. And no module of sim/ defines a class or function
under those names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import coordinator.index
import coordinator.policy
import engine.block_pool
import engine.kv_manager
import engine.scheduler
import gateway.serving.tiers
from sim.cluster import Layout, NodeGroup
from sim.run import simulate
from sim.workload import Synthetic, synthetic
from tests.sim.helpers import toy_profile

REAL = [
    (engine.scheduler.Scheduler, "schedule"),
    (engine.scheduler.Scheduler, "kv_ready"),
    (engine.block_pool.BlockPool, "allocate"),
    (engine.kv_manager.KVCacheManager, "find_cached_prefix"),
    (coordinator.policy.Router, "route"),
    (coordinator.index.PrefixIndex, "store"),
    (gateway.serving.tiers.Admission, "_acquire"),
]


def test_simulation_calls_the_real_code(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {f"{cls.__name__}.{name}": 0 for cls, name in REAL}

    def counting(cls: type, name: str):
        real = getattr(cls, name)
        key = f"{cls.__name__}.{name}"
        if name == "_acquire":

            async def wrapper(self, *a, **k):  # type: ignore[no-untyped-def]
                calls[key] += 1
                return await real(self, *a, **k)
        else:

            def wrapper(self, *a, **k):  # type: ignore[no-untyped-def]
                calls[key] += 1
                return real(self, *a, **k)

        return wrapper

    for cls, name in REAL:
        monkeypatch.setattr(cls, name, counting(cls, name))
    w = Synthetic(
        rate=5, duration_s=10, input_len="400", output_len="8", prefix_groups=2, prefix_len=64
    )
    s, _ = simulate(
        toy_profile(), Layout((NodeGroup("prefill", 1), NodeGroup("decode", 1))), synthetic(w)
    )
    assert s.completed == s.requests > 20
    assert s.paths == {"disaggregated": s.completed}
    assert all(n > 0 for n in calls.values()), calls


FORBIDDEN = {
    "Scheduler",
    "BlockPool",
    "KVCacheManager",
    "Router",
    "PrefixIndex",
    "Admission",
    "schedule",
    "allocate_slots",
    "find_cached_prefix",
    "_admit_waiting",
    "_acquire",
    "route_request",
}


def test_sim_defines_no_copy_of_them() -> None:
    root = Path(__file__).resolve().parents[2] / "sim"
    found = []
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and node.name in FORBIDDEN
            ):
                found.append(f"{path.name}:{node.lineno} {node.name}")
    assert not found, f"sim/ defines its own {found}: it must import the real one"


def test_sim_modules_bind_the_real_classes() -> None:
    import sim.cluster
    import sim.node

    assert sim.node.Scheduler is engine.scheduler.Scheduler
    assert sim.node.BlockPool is engine.block_pool.BlockPool
    assert sim.node.KVCacheManager is engine.kv_manager.KVCacheManager
    assert sim.cluster.Router is coordinator.policy.Router
    assert sim.cluster.Admission is gateway.serving.tiers.Admission
    assert sim.cluster.PrefixIndex is coordinator.index.PrefixIndex
