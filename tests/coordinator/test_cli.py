"""`duet coordinator` and `duet drain`: help, and operator mistakes as one line + exit 2."""

from __future__ import annotations

import subprocess
import sys


def duet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duet", *args], capture_output=True, text=True, timeout=60
    )


def test_help_explains_the_commands() -> None:
    out = duet("coordinator", "--help")
    assert out.returncode == 0
    for flag in (
        "--etcd",
        "--cluster",
        "--index-max-blocks",
        "--local-prefill-tokens",
        "POST /route",
    ):
        assert flag in out.stdout
    out = duet("drain", "--help")
    assert out.returncode == 0 and "--exit-when-drained" in out.stdout and "--wait" in out.stdout
    assert "--etcd URL" in duet("node", "--help").stdout


def test_bad_values_are_usage_errors() -> None:
    for args, text in (
        (("--index-max-blocks", "0"), "index-max-blocks"),
        (("--etcd", "ftp://x:1"), "etcd URL"),
        (("--etcd", "http://h:notaport"), "port"),
    ):
        out = duet("coordinator", *args)
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("duet coordinator: error:") and text in out.stderr


def test_node_rejects_a_bad_etcd_url() -> None:
    out = duet("node", "--etcd", "ftp://x", "--model", "nope")
    assert out.returncode == 2 and "etcd URL" in out.stderr
