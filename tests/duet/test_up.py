"""`duet up` from a fresh DUET_HOME: a whole cluster (etcd, coordinator, P and D nodes, gateway)
that answers the official openai client with the key it prints, keeps teams, keys and usage
across a restart, and leaves no process behind after SIGTERM or Ctrl-C (SIGINT)."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from duet.up_home import DEV_TEAM
from tests.procs import Proc, free_port

UP_FLAGS = ("--kv-blocks", "256", "--dtype", "float32", "--threads", "1", "--quiet")


def start_up(home: Path, model: Path, port: int, log: Path, *extra: str) -> Proc:
    args = [
        sys.executable,
        "-m",
        "duet",
        "up",
        "--model",
        str(model),
        "--port",
        str(port),
        *UP_FLAGS,
        *extra,
    ]
    return Proc(args, port, log, env={"DUET_HOME": str(home)})


def wait_banner(up: Proc, timeout: float = 240.0) -> str:
    """The API key printed once the cluster is up (the supervisor checks readiness itself)."""
    deadline = time.monotonic() + timeout
    while "all up" not in up.log():
        assert up.proc.poll() is None, up.log()[-4000:]
        assert time.monotonic() < deadline, up.log()[-4000:]
        time.sleep(0.1)  # polling the log for the readiness line
    m = re.search(r"API key\s+(sk-duet-\S+)", up.log())
    assert m, up.log()
    return m.group(1)


def block(text: str, start: str, end: str) -> str:
    """The printed snippet from the line starting with `start` up to the line `end` (kept when
    it is the heredoc's EOF, dropped when it is the blank line after a command)."""
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(start))
    j = next(k for k in range(i + 1, len(lines)) if lines[k] == end)
    return "\n".join(lines[i : j + (1 if end else 0)])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_and_check_nothing_left(up: Proc, home: Path, sig: int) -> None:
    state = json.loads((home / "up" / "state.json").read_text())
    pids = [c["pid"] for c in state["children"]]
    assert len(pids) == 5 and all(alive(p) for p in pids)
    up.proc.send_signal(sig)
    assert up.proc.wait(120) == 0, up.log()[-3000:]
    # Each child led its own process group: neither it nor anything it started is left.
    left = [p for p in pids if alive(p) or group_alive(p)]
    assert not left, (left, up.log()[-3000:])
    assert not (home / "up" / "state.json").exists()
    assert "duet up: stopped" in up.log()


def _metrics_show_no_team_without_a_credential(url: str, home: Path, team_key: str) -> None:
    """The gateway's `/metrics` (spend and tokens per team) answers the admin key only, by
    default: no credential and a team's own key get a 401 that names no team."""
    admin = (home / "up" / "admin.key").read_text().strip()
    for headers in ({}, {"Authorization": f"Bearer {team_key}"}):
        req = urllib.request.Request(url + "/metrics", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        body = e.value.read().decode()
        assert e.value.code == 401 and 'team="' not in body and "duet:" not in body, body
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {admin}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert f'team="{DEV_TEAM}"' in r.read().decode()  # the labels are there, behind the key


def _node_metrics_match_status(home: Path) -> None:
    """Each node's `vllm:*` metrics (what an endpoint picker scrapes) say what `duet status`
    shows for that node: waiting, running and KV use. Status reads the coordinator's last load
    frame, so the two agree once a frame after the last request has arrived: wait for that."""
    secret = (home / "up" / "cluster.secret").read_text().strip()
    names = {
        "waiting": "vllm:num_requests_waiting",
        "running": "vllm:num_requests_running",
        "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    }

    def pairs() -> list[tuple[str, str, float, float]]:
        status = subprocess.run(
            [sys.executable, "-m", "duet", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DUET_HOME": str(home)},
        )
        assert status.returncode == 0, status.stderr
        out = []
        for n in json.loads(status.stdout)["cluster"]["nodes"]:
            req = urllib.request.Request(
                n["url"] + "/metrics", headers={"Authorization": f"Bearer {secret}"}
            )
            text = urllib.request.urlopen(req, timeout=10).read().decode()
            for field, name in names.items():
                found = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
                assert len(found) == 1, (name, text)
                out.append((n["node_id"], field, float(n["load"][field]), float(found[0])))
        return out

    deadline = time.monotonic() + 30
    while True:
        seen = pairs()
        if all(abs(a - b) < 1e-9 for _, _, a, b in seen) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(abs(a - b) < 1e-9 for _, _, a, b in seen), seen
    assert {node for node, *_ in seen} == {"prefill-0", "decode-0"}


def test_up_fresh_home_openai_restart_keeps_usage_and_sigint_leaves_nothing(
    tiny_llama: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    port = free_port()
    up = start_up(home, tiny_llama, port, tmp_path / "up1.log")
    try:
        key = wait_banner(up)
        assert (home / "up" / "dev.key").read_text().strip() == key
        for f in ("dev.key", "admin.key"):
            assert stat.S_IMODE((home / "up" / f).stat().st_mode) == 0o600
        assert {p.name for p in (home / "logs").iterdir()} >= {
            "etcd.log",
            "coordinator.log",
            "prefill-0.log",
            "decode-0.log",
            "gateway.log",
        }
        client = openai.OpenAI(base_url=up.url + "/v1", api_key=key, max_retries=0)
        r = client.chat.completions.create(
            model=tiny_llama.name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
        )
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        _metrics_show_no_team_without_a_credential(up.url, home, key)
        # The KV crossed between prefill-0 and decode-0 over NIXL on loopback, with no statement
        # that the network is isolated: the nodes say they refuse peers on other hosts.
        for node in ("prefill-0", "decode-0"):
            log = (home / "logs" / f"{node}.log").read_text()
            assert "peers on other hosts are refused" in log and "--kv-network-isolated" in log
        # The snippets work exactly as printed.
        bindir = str(Path(sys.executable).parent)
        env = {**os.environ, "PATH": bindir + os.pathsep + os.environ["PATH"]}
        curl = subprocess.run(
            ["bash", "-c", block(up.log(), "curl ", "")],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        body = json.loads(curl.stdout.splitlines()[0] if curl.stdout else "{}")
        assert curl.returncode == 0 and body["usage"]["completion_tokens"] >= 1, (
            curl.stdout,
            curl.stderr,
        )
        py = subprocess.run(
            ["bash", "-c", block(up.log(), "python - <<'EOF'", "EOF")],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert py.returncode == 0 and py.stdout.strip(), py.stderr
        status = subprocess.run(
            [sys.executable, "-m", "duet", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DUET_HOME": str(home)},
        )
        assert status.returncode == 0, status.stderr
        info = json.loads(status.stdout)
        assert {(n["node_id"], n["role"]) for n in info["cluster"]["nodes"]} == {
            ("prefill-0", "prefill"),
            ("decode-0", "decode"),
        }
        assert info["cluster"]["leader"] == "coordinator-0" and info["gateway"]["status"] == "ok"
        _node_metrics_match_status(home)
        # One duet up per DUET_HOME.
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "duet",
                "up",
                "--model",
                str(tiny_llama),
                "--port",
                str(free_port()),
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DUET_HOME": str(home)},
        )
        assert second.returncode == 2 and "another duet up" in second.stderr
        stop_and_check_nothing_left(up, home, signal.SIGTERM)
    finally:
        up.kill()

    # Restart: same key, the usage of the first run is still there, new requests add to it.
    up = start_up(home, tiny_llama, port, tmp_path / "up2.log")
    try:
        assert wait_banner(up) == key
        assert "created now" not in up.log()
        client = openai.OpenAI(base_url=up.url + "/v1", api_key=key, max_retries=0)
        before = client.get("/usage", cast_to=object)["data"]
        assert (
            len(before) == 1 and before[0]["requests"] == 3 and before[0]["completion_tokens"] >= 5
        )
        client.completions.create(
            model=tiny_llama.name, prompt="again", max_tokens=3, temperature=0
        )
        after = client.get("/usage", cast_to=object)["data"]
        assert after[0]["requests"] == 4
        stop_and_check_nothing_left(up, home, signal.SIGINT)
    finally:
        up.kill()


def test_up_refuses_bad_layouts_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "DUET_HOME": str(tmp_path / "home")}
    bad = tmp_path / "cluster.toml"
    cases = {
        ("--colocated", "--prefill", "2"): "do not combine",
        ("--prefill", "1", "--decode", "0"): "no decode",
        ("--config", str(bad)): "unknown keys: nodez",
        ("--config", str(bad), "--prefill", "2"): "not both",
    }
    bad.write_text('[[nodez]]\nrole = "prefill"\n')
    for flags, msg in cases.items():
        r = subprocess.run(
            [sys.executable, "-m", "duet", "up", "--port", str(free_port()), *flags],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (
            flags,
            r.stderr,
        )
    r = subprocess.run(
        [sys.executable, "-m", "duet", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2 and "no `duet up` is running" in r.stderr


def test_cluster_toml_layout_and_cpu_plan() -> None:
    from duet.up_config import UpConfig, UpConfigError, parse_cluster_toml, plan_cpus

    cfg = parse_cluster_toml(
        {
            "model": "m",
            "gateway": {"port": 9000},
            "coordinator": {"replicas": 2},
            "nodes": [
                {"role": "prefill", "count": 2, "pool": "batch", "args": ["--x", "1"]},
                {"role": "decode", "model": "m"},
            ],
        },
        UpConfig(),
    )
    assert cfg.gateway.port == 9000 and cfg.coordinator.replicas == 2 and cfg.models() == ["m"]
    assert cfg.nodes[0].count == 2 and cfg.nodes[0].args == ("--x", "1")
    assert cfg.describe() == "2 prefill, 1 decode (m)"
    for bad, msg in [
        ({"nodes": [{"role": "prefill"}]}, "no decode"),
        ({"nodes": [{"role": "both", "count": 0}]}, "count >= 1"),
        ({"nodes": [{"role": "both", "pool": "gold"}]}, "pool"),
        ({"gateway": {"prot": 1}}, "unknown keys: prot"),
    ]:
        with pytest.raises(UpConfigError, match=msg):
            parse_cluster_toml(bad, UpConfig())
    assert plan_cpus(2, [0, 1]) == [[0], [1]]
    assert plan_cpus(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert plan_cpus(3, [0, 1]) == [None, None, None]


def test_cluster_toml_etcd_members_gateway_count_and_the_default_rule() -> None:
    """The issue's layout (2 coordinators, 3 etcd members, 1 P, 2 D, 2 gateways) in cluster.toml;
    every process's name known before any starts (the namespaces of --netns need them); two
    gateways by default only where the machine has 4 CPUs or more."""
    from duet.cmd_up import gateway_count, process_names
    from duet.up_config import UpConfig, UpConfigError, default_gateways, parse_cluster_toml

    cfg = parse_cluster_toml(
        {
            "gateway": {"count": 2},
            "coordinator": {"replicas": 2},
            "etcd": {"members": 3},
            "nodes": [{"role": "prefill"}, {"role": "decode", "count": 2}],
        },
        UpConfig(),
    )
    assert cfg.etcd.members == 3 and gateway_count(cfg) == 2
    assert process_names(cfg, 2) == [
        *("etcd-0", "etcd-1", "etcd-2", "coordinator-0", "coordinator-1"),
        *("prefill-0", "decode-0", "decode-1", "gateway-0", "gateway-1"),
    ]
    assert process_names(UpConfig(), 1) == [
        "etcd",
        "coordinator",
        "prefill-0",
        "decode-0",
        "gateway",
    ]
    assert [default_gateways(n) for n in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 2]
    for bad, msg in [
        ({"etcd": {"members": 2}}, "odd number"),
        ({"etcd": {"members": 0}}, "odd number"),
        ({"gateway": {"count": 0}}, r"--gateways must be at least 1, got 0 \(\[gateway\] count\)"),
        ({"etcd": {"member": 3}}, "unknown keys: member"),
    ]:
        with pytest.raises(UpConfigError, match=msg):
            parse_cluster_toml(bad, UpConfig())


def test_gateway_toml_routes_through_the_coordinator_or_statically() -> None:
    import tomllib
    from dataclasses import replace

    from duet.cmd_up import gateway_toml
    from duet.up_config import GatewaySection, UpConfig
    from gateway.config import parse_config

    cfg = UpConfig(model="/m/tiny")
    nodes = [
        ("/m/tiny", "prefill", "http://127.0.0.1:1"),
        ("/m/tiny", "decode", "http://127.0.0.1:2"),
    ]
    text = gateway_toml(
        cfg, "sqlite:///x.db", "ab" * 32, ["http://127.0.0.1:9"], {"/m/tiny": "tiny"}, nodes
    )
    gw = parse_config(tomllib.loads(text))
    assert gw.routing.coordinator == ("http://127.0.0.1:9",) and gw.models["tiny"].static is None
    assert gw.models["tiny"].tokenizer == "/m/tiny" and gw.server.admin_key_sha256 == "ab" * 32
    static = replace(cfg, gateway=GatewaySection(routing="static"))
    gw = parse_config(
        tomllib.loads(
            gateway_toml(
                static,
                "sqlite:///x.db",
                "ab" * 32,
                ["http://127.0.0.1:9"],
                {"/m/tiny": "tiny"},
                nodes,
            )
        )
    )
    assert gw.routing.coordinator == () and gw.models["tiny"].static.prefill == (
        "http://127.0.0.1:1",
    )
    assert gw.models["tiny"].static.decode == ("http://127.0.0.1:2",)


def test_help_names_up_and_status() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "duet", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "    up" in r.stdout and "    status" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "duet", "up", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "--colocated" in r.stdout and "$DUET_HOME/logs" in r.stdout


def test_up_config_layout_and_a_killed_up_leaves_no_orphans(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """SIGKILL gives the supervisor no chance to clean up: its children go by themselves."""
    home = tmp_path / "home"
    layout = tmp_path / "cluster.toml"  # a --config layout: one colocated node in the batch pool
    layout.write_text(
        '[coordinator]\nargs = ["--stale-load-s", "3"]\n[[nodes]]\nrole = "both"\npool = "batch"\n'
    )
    up = start_up(home, tiny_llama, free_port(), tmp_path / "up.log", "--config", str(layout))
    try:
        key = wait_banner(up)
        assert "duet is up: 1 colocated" in up.log()
        client = openai.OpenAI(base_url=up.url + "/v1", api_key=key, max_retries=0)
        # The node is in the batch pool: batch requests reach it, interactive ones find no node
        # there.
        r = client.completions.create(
            model=tiny_llama.name, prompt="x", max_tokens=2, extra_headers={"x-duet-tier": "batch"}
        )
        assert r.usage.completion_tokens == 2
        with pytest.raises(openai.InternalServerError, match="no decode node"):
            client.completions.create(model=tiny_llama.name, prompt="x", max_tokens=2)
        pids = [c["pid"] for c in json.loads((home / "up" / "state.json").read_text())["children"]]
        assert len(pids) == 4
        up.proc.send_signal(signal.SIGKILL)
        up.proc.wait(10)
        deadline = time.monotonic() + 90
        while any(alive(p) for p in pids):
            assert time.monotonic() < deadline, [p for p in pids if alive(p)]
            time.sleep(0.1)  # waiting for the children's own shutdown
        # The next start on the same home is not blocked by the dead one's lock or state.
        status = subprocess.run(
            [sys.executable, "-m", "duet", "status"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "DUET_HOME": str(home)},
        )
        assert status.returncode == 2 and "no `duet up` is running" in status.stderr
    finally:
        up.kill()
