"""Strict mode (DESIGN §6): under CI=true a broken feature fails the process instead of
running on its fallback. Each case breaks the feature from outside, the way it breaks on a
real machine (a compiler that fails, NIXL that does not import), in a real node process."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.strict import strict_mode
from tests.procs import Proc, free_port, running

NODE = ("--dtype", "float32", "--kv-blocks", "64", "--max-model-len", "256")


@pytest.fixture(autouse=True)
def _not_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test chooses strict mode itself, whatever the environment running the suite says."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("DUET_STRICT", raising=False)


def _failing_cc(tmp: Path) -> str:
    cc = tmp / "cc"
    cc.write_text("#!/bin/sh\necho 'rope_store.c:1: error: injected compile failure' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    return str(cc)


def _no_nixl(tmp: Path) -> str:
    """A directory that, first on PYTHONPATH, makes every NIXL wheel fail to import."""
    shim = tmp / "no-nixl"
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        (shim / name).mkdir(parents=True)
        (shim / name / "__init__.py").write_text("raise ImportError('NIXL blocked by the test')\n")
    return str(shim)


def _node(role: str, model: Path, tmp: Path, **env: str) -> Proc:
    """A node process with `env` added to this one's (PYTHONPATH entries go first)."""
    if "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "duet",
        "node",
        "--role",
        role,
        "--model",
        str(model),
        "--port",
        str(port),
        "--threads",
        "1",
        *NODE,
    ]
    return Proc(args, port, tmp / f"{role}-{port}.log", env=env)


def _serves(node: Proc) -> bool:
    """True once the node answers /health; False when it exits first. Stopped either way."""
    try:
        node.wait_healthy(120)
        return True
    except RuntimeError:  # it exited
        return False
    finally:
        node.terminate()


def test_strict_mode_reads_ci_and_duet_strict() -> None:
    assert (
        strict_mode({"CI": "true"})
        and strict_mode({"CI": "1"})
        and strict_mode({"DUET_STRICT": "yes"})
    )
    assert (
        not strict_mode({})
        and not strict_mode({"CI": "false"})
        and not strict_mode({"DUET_STRICT": "0"})
    )


def _kernels(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from engine.kernels import kernels_lib\nprint('kernels', kernels_lib() is not None)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_kernel_compile_failure_is_a_warning_outside_ci(tmp_path: Path) -> None:
    r = _kernels(dict(os.environ, CC=_failing_cc(tmp_path), DUET_HOME=str(tmp_path)))
    assert r.returncode == 0 and "kernels False" in r.stdout
    assert (
        "injected compile failure" in r.stderr
        and "falling back to the slower torch ops" in r.stderr
    )


def test_disabling_kernels_on_purpose_is_allowed_under_ci_and_logged(tmp_path: Path) -> None:
    r = _kernels(dict(os.environ, CI="true", DUET_DISABLE_KERNELS="1", DUET_HOME=str(tmp_path)))
    assert r.returncode == 0 and "kernels False" in r.stdout
    assert "DUET_DISABLE_KERNELS is set" in r.stderr


def test_kernel_compile_failure_fails_the_node_under_ci(tiny_llama: Path, tmp_path: Path) -> None:
    node = _node(
        "both", tiny_llama, tmp_path, CI="true", CC=_failing_cc(tmp_path), DUET_HOME=str(tmp_path)
    )
    assert not _serves(node), "the node served on the torch fallback under CI=true"
    assert node.proc.returncode != 0
    log = node.log()
    assert (
        "FallbackRefused" in log
        and "injected compile failure" in log
        and "strict mode (CI=true)" in log
    )


def test_nixl_import_failure_fails_the_node_under_ci(tiny_llama: Path, tmp_path: Path) -> None:
    node = _node("prefill", tiny_llama, tmp_path, CI="true", PYTHONPATH=_no_nixl(tmp_path))
    assert not _serves(node), "the node served on tcp under CI=true"
    assert node.proc.returncode != 0
    log = node.log()
    assert "NIXL blocked by the test" in log and "refuses to fall back to the tcp backend" in log


def test_nixl_import_failure_falls_back_to_tcp_outside_ci(tiny_llama: Path, tmp_path: Path) -> None:
    node = _node("prefill", tiny_llama, tmp_path, PYTHONPATH=_no_nixl(tmp_path))
    with running(node):
        log = node.log()
    assert "NIXL blocked by the test" in log and "falling back to the tcp backend" in log
    assert "KV transport: tcp" in log


def test_linear_prepacking_failure_is_an_error_in_strict_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A oneDNN prepack that fails its self-check falls back to F.linear with a warning in
    production, and is an error under CI=true (it would hide a broken fast path)."""
    import torch
    import torch.nn.functional as F

    from engine import linear
    from runtime.strict import FallbackRefused

    w = torch.randn(64, 64).to(torch.bfloat16)
    monkeypatch.setenv(
        "DUET_BF16_LINEAR", "onednn"
    )  # AVX-512 BF16 CPUs take linear_bf16.c otherwise
    if not linear.can_prepack(w):
        pytest.skip("this torch/CPU does not prepack bf16 linears")
    real = F.linear
    monkeypatch.setattr(
        F, "linear", lambda x, w, b=None: real(x, w, b) + 1
    )  # the self-check disagrees
    monkeypatch.delenv("DUET_STRICT", raising=False)
    monkeypatch.setenv("CI", "false")
    assert linear.Linear(w).packed is None  # fell back
    monkeypatch.setenv("CI", "true")
    with pytest.raises(FallbackRefused, match="prepacking"):
        linear.Linear(w)
