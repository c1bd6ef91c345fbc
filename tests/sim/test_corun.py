"""The co-run measurement (sim/corun.py) on a tiny random Llama: it times a prefill and a decode
step alone and beside a real second engine process, stops that process, leaves the core empty,
and a neighbour that cannot start is a clear error, not a hang."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from protocol.profile import Provenance
from sim import corun

KW = {
    "dtype": "float32",
    "threads": 1,
    "quantization": None,
    "kv_memory": "8MiB",
    "max_model_len": 512,
}


@pytest.fixture
def core(tiny_llama: Path) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(tiny_llama),
            device="cpu",
            dtype="float32",
            threads=1,
            kv_memory="8MiB",
            max_model_len=512,
            max_num_batched_tokens=128,
            enable_prefix_caching=False,
        )
    )


def test_measure_times_both_shapes_beside_a_real_neighbour(
    core: EngineCore, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(*args, **kwargs):  # type: ignore[no-untyped-def]
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(corun.subprocess, "Popen", popen)
    lines: list[str] = []
    c = corun.measure(core, model=str(tiny_llama), log=lines.append, reps=3, **KW)
    assert c.provenance is Provenance.MEASURED and c.cpus >= 1
    assert [s.name for s in c.shapes] == ["prefill", "decode"]
    assert all(s.alone_cpu_s > 0 and s.beside_cpu_s > 0 for s in c.shapes)
    assert c.prefill_factor >= 1.0 and c.decode_factor >= 1.0
    assert len(started) == 1 and started[0].poll() is not None  # the neighbour ran, and is stopped
    assert not core.has_work() and not core.scheduler.requests
    assert any("co-run:" in line and "×" in line for line in lines)


def test_a_neighbour_that_cannot_start_is_an_error(core: EngineCore, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="neighbour did not start"):
        corun.measure(core, model=str(tmp_path / "no-such-model"), log=lambda m: None, reps=1, **KW)
