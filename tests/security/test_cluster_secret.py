"""Where the cluster secret comes from, and what a process does without one (issue #22).

A secret others can read is no secret, a short one can be guessed, and a process that quietly
starts open on a network address because its secret was missing is the hole this closes:
- a secret file readable or writable by group/others, a secret under 32 bytes, an unreadable
  file are refused — never a start without the secret;
- without any secret, a process on loopback starts with a warning; on another address it
  refuses unless `--insecure` (real `duet node` / `duet coordinator` processes: exit 2 before
  anything loads);
- `duet up` generates the secret 0600 under $DUET_HOME, keeps it, and replaces one that is
  not valid.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from duet.up_home import UpHome, cluster_secret
from protocol.cluster_secret import (
    ENV_SECRET,
    ENV_SECRET_FILE,
    ClusterSecret,
    SecretError,
    load_secret,
    write_secret_file,
)
from protocol.plane import PlaneSecurity

GOOD = secrets.token_urlsafe(32)


def _file(tmp: Path, value: str, mode: int = 0o600) -> Path:
    p = tmp / "secret"
    write_secret_file(p, value)
    p.chmod(mode)
    return p


def test_a_file_secret_is_read_and_wins_over_the_environment(tmp_path: Path) -> None:
    p = _file(tmp_path, GOOD)
    other = secrets.token_urlsafe(32)
    s = load_secret(str(p), env={ENV_SECRET: other})
    assert s is not None and s.verify(f"Bearer {GOOD}") and not s.verify(f"Bearer {other}")
    s = load_secret(None, env={ENV_SECRET_FILE: str(p), ENV_SECRET: other})
    assert s is not None and s.verify(f"Bearer {GOOD}")
    s = load_secret(None, env={ENV_SECRET: other})
    assert s is not None and s.verify(f"Bearer {other}")
    assert load_secret(None, env={}) is None
    assert GOOD not in repr(s)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o620])
def test_a_file_others_can_reach_is_refused(tmp_path: Path, mode: int) -> None:
    p = _file(tmp_path, GOOD, mode)
    with pytest.raises(SecretError, match="chmod 600"):
        load_secret(str(p), env={})


@pytest.mark.parametrize("value", ["x" * 31, "short", "a b" * 20, "é" * 40])
def test_weak_or_unsendable_secrets_are_refused(tmp_path: Path, value: str) -> None:
    with pytest.raises(SecretError):
        load_secret(str(_file(tmp_path, value)), env={})
    with pytest.raises(SecretError):
        load_secret(None, env={ENV_SECRET: value})


def test_a_configured_but_missing_file_is_an_error_not_an_open_start(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(str(tmp_path / "nope"), env={ENV_SECRET: GOOD})


def test_verification_needs_the_exact_bearer_value() -> None:
    s = ClusterSecret(GOOD, "test")
    assert s.verify(f"Bearer {GOOD}")
    for wrong in (None, "", GOOD, f"Bearer {GOOD}x", f"Bearer {GOOD[:-1]}", f"bearer{GOOD}", "Bearer é"):
        assert not s.verify(wrong)


def test_without_a_secret_loopback_warns_and_other_addresses_need_insecure(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "duet.security"):
        PlaneSecurity().check_start(["127.0.0.1"], "a node")
    assert "WITHOUT a cluster secret" in caplog.text
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        with pytest.raises(SecretError, match="--insecure"):
            PlaneSecurity().check_start([host], "a node")
    PlaneSecurity(insecure=True).check_start(["0.0.0.0"], "a node")  # the operator's explicit choice
    PlaneSecurity(secret=ClusterSecret(GOOD, "t")).check_start(["0.0.0.0"], "a node")
    with pytest.raises(SecretError, match="--protect-metrics"):
        PlaneSecurity(protect_metrics=True).check_start(["127.0.0.1"], "a node")


@pytest.mark.parametrize("command", [["node", "--role", "decode"], ["coordinator", "--etcd", "http://127.0.0.1:9"]])
def test_a_process_on_a_network_address_without_a_secret_refuses_to_start(command: list[str], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SECRET, ENV_SECRET_FILE)}
    r = subprocess.run([sys.executable, "-m", "duet", *command, "--host", "0.0.0.0", "--port", "9"],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "without a cluster secret" in r.stderr and "--insecure" in r.stderr


def test_help_says_how_to_run_without_a_secret() -> None:
    out = subprocess.run([sys.executable, "-m", "duet", "node", "--help"], capture_output=True, text=True,
                         timeout=60).stdout  # fmt: skip
    out = " ".join(out.split())  # argparse wraps lines
    assert "--insecure" in out and "--cluster-secret-file" in out and "refuses to start" in out


def test_duet_up_generates_a_private_secret_and_keeps_it(tmp_path: Path) -> None:
    home = UpHome(tmp_path)
    home.prepare()
    path = cluster_secret(home)
    assert path.stat().st_mode & 0o777 == 0o600
    first = path.read_text()
    assert load_secret(str(path), env={}) is not None
    assert cluster_secret(home).read_text() == first  # kept across restarts
    path.chmod(0o644)  # someone loosened it: a new one, private again
    assert cluster_secret(home).read_text() != first
    assert path.stat().st_mode & 0o777 == 0o600
