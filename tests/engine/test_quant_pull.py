"""`duet models pull NAME --quantize SCHEME`: quantize once, cache beside the full-precision
copy, and an engine started with that quantization loads the cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.quant_store import cache_path, load_quantized
from runtime.models import DEFAULT_MODEL


def _duet(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DUET_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "duet", *args], capture_output=True, text=True, env=env, timeout=600
    )


@pytest.mark.smollm2
def test_pull_quantize_caches_once(smollm2: Path, tmp_path: Path) -> None:
    # A private DUET_HOME whose model files link to the pulled SmolLM2 (nothing written there).
    model = tmp_path / "models" / DEFAULT_MODEL
    model.mkdir(parents=True)
    for f in smollm2.iterdir():
        if f.is_file():
            (model / f.name).symlink_to(f)
    proc = _duet("models", "pull", "--quantize", "int4", home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "already pulled" in proc.stderr and "cached int4 weights" in proc.stderr
    path = cache_path(model, "int4")
    cached = load_quantized(model, "int4")
    assert cached is not None and len(cached) == 4 * 30 + 1  # 4 linears x 30 layers + lm_head
    # int4 layers are ~5/16 of bf16 and the lm_head int8: well under half the bf16 size
    assert path.stat().st_size < 0.45 * 2 * 134.5e6
    mtime = path.stat().st_mtime_ns

    again = _duet("models", "pull", "--quantize", "int4", home=tmp_path)
    assert again.returncode == 0 and "already quantized to int4" in again.stderr
    assert path.stat().st_mtime_ns == mtime
    listing = _duet("models", "list", home=tmp_path)
    assert f"{DEFAULT_MODEL} [int4]" in listing.stdout

    bad = _duet("models", "pull", "--quantize", "int3", home=tmp_path)
    assert bad.returncode == 2 and "invalid choice: 'int3'" in bad.stderr
