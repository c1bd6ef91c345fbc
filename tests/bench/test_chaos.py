"""`duet bench chaos` end to end on the tiny model: it starts its own `duet up` (2 coordinator
replicas, 1 prefill, 2 decode nodes), kills a process every few seconds under mixed load, and
reports what self-healing must deliver — every request answered, each killed process back, no KV
block held once the load is over, the batch's lines done exactly once, usage equal to the
client's counts — with the plot written, and leaves no process behind."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

CLUSTER = """
[coordinator]
replicas = 2
[[nodes]]
role = "prefill"
[[nodes]]
role = "decode"
count = 2
"""


def test_chaos_on_a_started_duet_up(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "cluster.toml").write_text(CLUSTER)
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "duet",
            "bench",
            "chaos",
            "--up-config",
            str(tmp_path / "cluster.toml"),
            f"--up-arg=--model={tiny_llama}",
            "--up-arg=--kv-blocks=256",
            "--up-arg=--dtype=float32",
            "--up-arg=--threads=1",
            "--kill",
            "prefill,decode,coordinator,etcd",
            "--duration",
            "24",
            "--kill-every",
            "7",
            "--streams",
            "2",
            "--plain",
            "1",
            "--batch-lines",
            "6",
            "--max-tokens",
            "8",
            "--settle",
            "60",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(r.stdout)
    assert s == json.loads((out / "chaos.json").read_text())
    assert (out / "chaos.png").stat().st_size > 10_000 and (out / "logs" / "gateway.log").exists()
    assert len(s["kills"]) == 3 and s["not_back"] == [], s["kills"]
    assert s["requests"] > 0 and s["undefined"] == 0, s["causes"]
    assert s["kv_blocks_held_after"] and not any(s["kv_blocks_held_after"].values()), s[
        "kv_blocks_held_after"
    ]
    assert s["batch"]["exactly_once"] and s["batch"]["done_once"] == 6, s["batch"]
    assert s["usage"]["requests_match"], s["usage"]
    assert len(s["timeline"]) >= 4 and sum(b["requests"] for b in s["timeline"]) == s["requests"]
    assert "SIGKILL" in r.stderr and "stopping the duet up it started" in r.stderr


def test_chaos_refuses_bad_flags() -> None:
    for flags, msg in [
        ([], "give --url"),
        (["--url", "http://x", "--up-config", "c.toml"], "not both"),
        (["--url", "http://x", "--kill", "gpu"], "unknown kinds"),
        (["--url", "http://x", "--streams", "0", "--plain", "0"], "at least one"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "duet", "bench", "chaos", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (
            flags,
            r.stderr,
        )


def test_gateways_are_victims_only_while_another_keeps_the_port(tmp_path: Path) -> None:
    """The killer draws a gateway only when `duet up --gateways N` runs two or more (one dying
    leaves the port to another), unless an explicit --kill list says otherwise; with one gateway
    its death is an outage by design. The issue: "a gateway when there are two"."""
    import json

    from bench.chaos_kill import Killer

    state = tmp_path / "state.json"

    def names(gateways: int, **kw: bool) -> set[str]:
        children = [{"name": "decode-0", "state": "running", "pid": 10}]
        children += [
            {"name": f"gateway-{i}", "state": "running", "pid": 20 + i} for i in range(gateways)
        ]
        state.write_text(json.dumps({"children": children}))
        killer = Killer(state, {"decode"}, 30, 0, 0.0, lambda _m: None, **kw)
        return {c["name"] for c in killer.candidates()}

    assert names(1) == {"decode-0"}
    assert names(2) == {"decode-0", "gateway-0", "gateway-1"}
    assert names(2, gateways_when_several=False) == {"decode-0"}


FULL = """
[gateway]
count = 2
[coordinator]
replicas = 2
args = ["--local-prefill-tokens", "16"]
[etcd]
members = 3
[[nodes]]
role = "prefill"
[[nodes]]
role = "decode"
count = 2
"""


def test_chaos_faults_past_sigkill_in_namespaces(tiny_llama: Path, tmp_path: Path) -> None:
    """The issue's layout (2 coordinators, 3 etcd members, 1 P, 2 D, 2 gateways), every process
    in a network namespace of its own: SIGSTOP, partitions, delay and loss between pairs and the
    etcd quorum lost, each logged with its start and end — every request answered, no KV held,
    the batch once, usage per request, and no namespace left behind."""
    from runtime import netns
    from runtime.strict import strict_mode

    if why := netns.refused():
        if strict_mode():
            pytest.fail(f"{why}; under CI=true the namespace chaos test must run, not skip")
        pytest.skip(why)
    (tmp_path / "cluster.toml").write_text(FULL)
    out = tmp_path / "out"
    faults = [
        *("--stop-every", "20", "--stop-for", "5", "--partition-every", "12"),
        *("--partition-for", "6", "--delay-every", "20", "--delay-for", "6"),
        *("--loss-every", "20", "--loss-for", "6", "--etcd-every", "30", "--etcd-for", "10"),
        *("--delay-ms", "50", "--jitter-ms", "10"),
    ]
    r = subprocess.run(
        [
            *(sys.executable, "-m", "duet", "bench", "chaos"),
            *("--up-config", str(tmp_path / "cluster.toml"), f"--up-arg=--model={tiny_llama}"),
            *("--up-arg=--kv-blocks=256", "--up-arg=--dtype=float32", "--up-arg=--threads=1"),
            *("--faults", "stop,partition,delay,loss,etcd", "--duration", "36", *faults),
            *("--streams", "2", "--plain", "1", "--batch-lines", "4", "--max-tokens", "8"),
            *("--settle", "60", "--out", str(out), "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(r.stdout)
    kinds = {f["kind"] for f in s["faults"]}
    assert kinds == {"stop", "partition", "delay", "loss", "etcd"}, s["faults"]
    # every fault ended (the last ones as the load ended: a delayer's exit takes a moment)
    assert all(f["start_s"] < f["end_s"] <= 36 + 15 for f in s["faults"]), s["faults"]
    assert set(s["by_fault"]) == kinds and all(c["requests"] for c in s["by_fault"].values())
    assert s["requests"] > 0 and s["undefined"] == 0, s["causes"]
    assert s["kv_blocks_held_after"] and not any(s["kv_blocks_held_after"].values())
    assert s["batch"]["exactly_once"], s["batch"]
    assert s["usage"]["requests_match"], s["usage"]
    assert (out / "chaos.png").stat().st_size > 10_000
    prefix = re.search(r"network namespaces (dc\d+)-", r.stderr)
    assert prefix is not None, r.stderr[-2000:]
    assert netns.namespaces(prefix[1]) == [], "namespaces left behind"


def test_chaos_slowfs_bills_once_and_locks_nobody_out(tiny_llama: Path, tmp_path: Path) -> None:
    """The gateway's store slow to commit (each write waits up to 2 s for the write lock, as
    behind a 2 s fsync) twice during the load: every request is answered, none billed twice,
    usage matches the client's requests, the batch's lines are done once, and requests after the
    fault are served (no team locked out by the slow writes)."""
    (tmp_path / "cluster.toml").write_text('[[nodes]]\nrole = "both"\n')
    out = tmp_path / "out"
    r = subprocess.run(
        [
            *(sys.executable, "-m", "duet", "bench", "chaos"),
            *("--up-config", str(tmp_path / "cluster.toml"), f"--up-arg=--model={tiny_llama}"),
            *("--up-arg=--kv-blocks=256", "--up-arg=--dtype=float32", "--up-arg=--threads=1"),
            *("--faults", "slowfs", "--duration", "40", "--slowfs-every", "20"),
            *("--slowfs-for", "6", "--slowfs-commit-s", "2"),
            *("--streams", "2", "--plain", "1", "--batch-lines", "4", "--max-tokens", "8"),
            *("--settle", "60", "--out", str(out), "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(r.stdout)
    faults = s["faults"]
    assert faults and {f["kind"] for f in faults} == {"slowfs"}, faults
    assert int(re.search(r"(\d+) slow commits", faults[0]["detail"])[1]) >= 2, faults
    assert s["by_fault"]["slowfs"]["requests"] > 0, s["by_fault"]

    def clear(b: dict[str, float]) -> bool:  # a 5 s bin of send time clear of every fault
        return all(b["t"] + 5 <= f["start_s"] or b["t"] >= f["end_s"] + 2 for f in faults)

    quiet = [b for b in s["timeline"] if clear(b)]
    assert any(b["t"] >= faults[0]["end_s"] for b in quiet), (faults, s["timeline"])
    assert all(b["requests"] == b["full"] for b in quiet), s["timeline"]
    assert s["requests"] > 0 and s["undefined"] == 0, s["causes"]
    assert s["usage"]["requests_match"], s["usage"]
    assert not s["usage"]["matched"]["billed_twice"], s["usage"]["matched"]
    assert s["batch"]["exactly_once"], s["batch"]
