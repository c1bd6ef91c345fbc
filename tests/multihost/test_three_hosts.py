"""The multi-machine path on one machine: a cluster over three network namespaces.

Host A runs etcd, a coordinator and the gateway; host B a prefill node; host C a decode node;
the three are joined by veth pairs on a bridge (tests/multihost/netns.py), each with its own
address, and every process reaches the others only through those interfaces, by the addresses
they registered in etcd, with the cluster secret on every internal call. UCX is told to use TCP over
each host's veth (`UCX_TLS=tcp`, `UCX_NET_DEVICES=eth0`): within one machine it would otherwise pick
cma (a process_vm_readv copy that needs no network at all), which would prove nothing about crossing
hosts.

One completion through the gateway with the official openai client must:
- be disaggregated (the coordinator counts it so) and equal the decode node's own colocated
  answer for the same token ids;
- have moved its KV with NIXL (both nodes' transport metadata say `nixl`, the decode node's
  `duet:kv_transfer_bytes_total` grew), and those bytes crossed host C's veth: its receive
  counter grew by at least the KV bytes pulled, its loopback by less.

The last test runs the prefill Deployment's preStop hook from deploy/ (the command itself, read
from the manifest) inside host B, as the kubelet would: it must drain the node through the node's
own endpoint (no fallback), and the coordinator on host A must see the node draining.

Skips (with the reason) only where the kernel refuses namespaces or the test is not root; never
under CI=true (runtime/strict.py), where that would hide the multi-machine path. Every
process and namespace is removed at the end, pass or fail (`running` and `lan` guarantee it).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from coordinator.etcd_server import EtcdServer
from kvtransfer.metadata import decode_metadata
from runtime.strict import strict_mode
from tests.gateway.helpers import ADMIN_KEY, make_team, metric, write_config
from tests.multihost import netns
from tests.procs import TINY_NODE_ARGS, Proc, running
from tests.wait import wait_for
from text.tokenizer import Tokenizer

MODEL = "tiny"
ETCD_PORT, COORD_PORT, GATEWAY_PORT, PREFILL_PORT, DECODE_PORT = 2379, 8400, 8000, 8100, 8200
#: UCX over the host's veth only: TCP, no shared memory or cma (see the module docstring)
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": netns.HOST_DEV}
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
#: ~24 blocks of 16 tokens: far more KV bytes than the HTTP legs carry, so the veth counter
#: can tell a transfer from the requests around it
PROMPT = "Host A routes, host B prefills and host C decodes across a real interface. " * 6


def _skip_unless_namespaces() -> None:
    """Skip where `ip netns add` is refused — but fail under CI=true, where a skip would hide the
    multi-machine path."""
    reason = netns.refused()
    if reason:
        if strict_mode():
            pytest.fail(f"{reason}; under CI=true the three-host test must run, not skip")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def lan() -> Iterator[netns.Lan]:
    _skip_unless_namespaces()
    with netns.lan(["a", "b", "c"]) as lan:
        yield lan


def _in(
    host: netns.Host, args: list[str], port: int, log: Path, env: dict[str, str] | None = None
) -> Proc:
    p = Proc(host.exec(args), port, log, env)
    p.url = f"http://{host.ip}:{port}"  # reached over the bridge, not the test's own loopback
    return p


def _node_args(host: netns.Host, role: str, port: int, model: Path, *extra: str) -> list[str]:
    # On every address, as in a pod: the preStop hook reaches it on 127.0.0.1, peers on host.ip.
    return [
        sys.executable,
        "-m",
        "duet",
        "node",
        "--role",
        role,
        "--model",
        str(model),
        "--threads",
        "1",
        "--host",
        "0.0.0.0",
        "--advertise-host",
        host.ip,
        "--port",
        str(port),
        *TINY_NODE_ARGS,
        *extra,
    ]


@dataclass
class Cluster:
    lan: netns.Lan
    coordinator: Proc
    prefill: Proc
    decode: Proc
    gateway: Proc
    key: str
    etcd_url: str
    #: the cluster secret's file (DESIGN §8), given to every process as DUET_CLUSTER_SECRET_FILE
    secret_file: Path

    def get(self, url: str) -> Any:
        """An internal endpoint, called the way cluster members call it (with the cluster
        secret)."""
        req = urllib.request.Request(
            url, headers={"Authorization": "Bearer " + self.secret_file.read_text()}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.read()

    def cluster(self) -> dict[str, Any]:
        return json.loads(self.get(self.coordinator.url + "/cluster"))


@pytest.fixture(scope="module")
def cluster(
    lan: netns.Lan, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("three-hosts")
    secret_file = tmp / "cluster-secret"
    secret_file.write_text(secrets.token_hex(32))
    secret_file.chmod(0o600)
    env = {"DUET_CLUSTER_SECRET_FILE": str(secret_file)}
    a, b, c = lan.hosts["a"], lan.hosts["b"], lan.hosts["c"]
    # EtcdServer writes the etcd command line; its addresses are host A's, in A's namespace.
    etcd_cmd = EtcdServer(tmp / "etcd", port=ETCD_PORT)
    etcd_cmd.host, etcd_cmd.peer_port = a.ip, ETCD_PORT + 1
    etcd_url = etcd_cmd.url
    etcd = _in(a, etcd_cmd.command(), ETCD_PORT, tmp / "etcd.log")
    coord = _in(
        a,
        [
            sys.executable,
            "-m",
            "duet",
            "coordinator",
            "--etcd",
            etcd_url,
            "--host",
            a.ip,
            "--port",
            str(COORD_PORT),
            "--local-prefill-tokens",
            "8",
        ],
        COORD_PORT,
        tmp / "coordinator.log",
        env,
    )

    def node(host: netns.Host, role: str, port: int) -> Proc:
        # The operator's statement that only the cluster's nodes reach this LAN: NIXL crosses it.
        args = _node_args(host, role, port, tiny_llama, "--kv-network-isolated")
        args += ["--etcd", etcd_url, "--node-id", f"{role}-{host.name}"]
        return _in(host, args, port, tmp / f"{role}.log", {**UCX_ENV, **env})

    p, d = node(b, "prefill", PREFILL_PORT), node(c, "decode", DECODE_PORT)
    model = {
        "kind": "cluster",
        "tokenizer": str(tiny_llama),
        "served_name": tiny_llama.name,
        "input_usd_per_mtok": 1.0,
        "output_usd_per_mtok": 2.0,
    }
    cfg = write_config(
        tmp / "gateway.toml",
        {MODEL: model},
        server={"host": a.ip, "port": GATEWAY_PORT},
        store={"url": f"sqlite://{tmp / 'gateway.db'}"},
        routing={"coordinator": [coord.url]},
    )
    g = _in(
        a,
        [sys.executable, "-m", "duet", "gateway", "--config", str(cfg)],
        GATEWAY_PORT,
        tmp / "gateway.log",
        {"DUET_ADMIN_KEY": ADMIN_KEY, **env},
    )
    with running(etcd, coord, p, d, g):
        c = Cluster(lan, coord, p, d, g, make_team(g.url, "netns"), etcd_url, secret_file)
        wait_for(
            lambda: (
                {"prefill-b", "decode-c"}
                <= {n["node_id"] for n in c.cluster()["nodes"] if n["ready"]}
            ),
            60,
            "both nodes registered and ready at the coordinator",
        )
        yield c


def _backend(c: Cluster, node: Proc) -> str:
    return decode_metadata(c.get(node.url + "/kv/metadata")).backend


def _completion(c: Cluster, node: Proc, ids: list[int], max_tokens: int) -> str:
    body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(
        node.url + "/v1/completions",
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Authorization": "Bearer " + c.secret_file.read_text(),
        },
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_a_completion_crosses_three_hosts_with_kv_over_nixl(
    cluster: Cluster, tiny_llama: Path
) -> None:
    c, host_c = cluster, cluster.lan.hosts["c"]
    assert _backend(c, c.prefill) == "nixl" and _backend(c, c.decode) == "nixl"
    routed = metric(c.coordinator.url, 'duet:route_decisions_total{outcome="disaggregated"}')
    pulled = metric(c.decode.url, "duet:kv_transfer_bytes_total")
    rx, lo = host_c.rx_bytes(), host_c.rx_bytes("lo")

    client = openai.OpenAI(base_url=c.gateway.url + "/v1", api_key=c.key, max_retries=0)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)

    kv_bytes = metric(c.decode.url, "duet:kv_transfer_bytes_total") - pulled
    rx_delta, lo_delta = host_c.rx_bytes() - rx, host_c.rx_bytes("lo") - lo
    assert (
        metric(c.coordinator.url, 'duet:route_decisions_total{outcome="disaggregated"}')
        == routed + 1
    )
    ids = Tokenizer(tiny_llama).encode(PROMPT)
    assert kv_bytes > 0 and len(ids) >= 16 * 20, (
        f"the decode node pulled {kv_bytes} B for {len(ids)} tokens"
    )
    assert rx_delta >= kv_bytes, (
        f"host C's veth received {rx_delta} B, less than the {kv_bytes} B of KV pulled"
    )
    assert lo_delta < kv_bytes, (
        f"host C's loopback carried {lo_delta} B: the KV did not cross hosts"
    )
    assert got.choices[0].text and got.choices[0].text == _completion(c, c.decode, ids, 8)


def _post(c: Cluster, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": "Bearer " + c.secret_file.read_text(),
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _refused_for_isolation(status: int, body: dict[str, Any]) -> None:
    assert status == 403, body
    err = body["error"]
    assert err["code"] == "kv_network_not_isolated", err
    assert "--kv-network-isolated" in err["message"] and "--transport tcp" in err["message"], err


def test_without_the_isolation_statement_nixl_peers_on_other_hosts_are_refused(
    cluster: Cluster, tiny_llama: Path, tmp_path: Path
) -> None:
    """A nixl node started without `--kv-network-isolated` (host C) exchanges no KV with
    another host, both ways: its metadata (the pool's memory keys) is refused to a caller on
    another host (the test's root namespace) yet served on its own host, and a decode leg naming
    the prefill node on host B is refused before any byte moves, while the cluster's decode node
    (stated) pulls that kind of KV from host B: the first test."""
    c, host_c = cluster, cluster.lan.hosts["c"]
    env = {**UCX_ENV, "DUET_CLUSTER_SECRET_FILE": str(c.secret_file)}
    port = DECODE_PORT + 1
    x = _in(host_c, _node_args(host_c, "decode", port, tiny_llama), port, tmp_path / "x.log", env)
    with running(x):
        assert _backend(c, c.prefill) == "nixl"  # stated: served to another host
        # The owner's side: not handed to another host, with the reason ...
        with pytest.raises(urllib.error.HTTPError) as e:
            c.get(x.url + "/kv/metadata")
        _refused_for_isolation(e.value.code, json.loads(e.value.read()))
        # ... but served on its own host (loopback, and its own LAN address).
        for addr in ("127.0.0.1", host_c.ip):
            fetch = (
                "import sys, urllib.request as u; r = u.Request(sys.argv[1], headers="
                "{'Authorization': 'Bearer ' + open(sys.argv[2]).read()}); "
                "print(u.urlopen(r, timeout=10).read().decode())"
            )
            url, secret = f"http://{addr}:{port}/kv/metadata", str(c.secret_file)
            out = subprocess.run(
                host_c.exec([sys.executable, "-c", fetch, url, secret]),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            assert decode_metadata(out.stdout.strip()).backend == "nixl"
        # The reader's side: a real prefill leg on host B, its KV offered to x on host C.
        ids = Tokenizer(tiny_llama).encode("An unstated network carries no KV between hosts.")
        leg = {"prompt": ids, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, held = _post(c, c.prefill.url + "/v1/completions", leg)
        assert status == 200 and held["kv_transfer_params"]["remote_host"] == c.lan.hosts["b"].ip
        decode = {"prompt": ids, "max_tokens": 2, "temperature": 0}
        status, body = _post(
            c,
            x.url + "/v1/completions",
            {**decode, "kv_transfer_params": held["kv_transfer_params"]},
        )
        _refused_for_isolation(status, body)
        assert metric(x.url, "duet:kv_transfer_bytes_total") == 0
        assert "--kv-network-isolated" in x.log()  # the refusals are logged, not silent


def test_the_prestop_hook_drains_the_prefill_node(cluster: Cluster) -> None:
    c, host_b = cluster, cluster.lan.hosts["b"]
    manifest = yaml.safe_load_all((DEPLOY / "base" / "prefill.yaml").read_text())
    pod = next(d for d in manifest if d and d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["containers"][0]["ports"][0]["containerPort"] == PREFILL_PORT
    hook = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    # The container's environment as the manifest sets it (POD_NAME is the node id there too).
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "POD_NAME": "prefill-b",
        "DUET_ETCD": c.etcd_url,
        "DUET_CLUSTER": "default",
        "DUET_CLUSTER_SECRET_FILE": str(c.secret_file),
    }
    r = subprocess.run(
        host_b.exec(["env", *(f"{k}={v}" for k, v in env.items()), *hook]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    # The node's endpoint answered (the fallback would have printed the python error first).
    assert r.returncode == 0 and not r.stderr, r.stderr
    status = json.loads(c.get(c.prefill.url + "/drain"))
    assert status["draining"] and status["idle"], status
    wait_for(
        lambda: any(
            n["node_id"] == "prefill-b" and n["status"] == "draining" for n in c.cluster()["nodes"]
        ),
        30,
        "the coordinator on host A sees prefill-b draining",
    )


def test_the_lan_is_torn_down_when_its_block_fails() -> None:
    _skip_unless_namespaces()
    with pytest.raises(RuntimeError, match="boom"), netns.lan(["x"]) as lan:
        ns = lan.hosts["x"].ns
        sleeper = subprocess.Popen(lan.hosts["x"].exec(["sleep", "600"]))
        raise RuntimeError("boom")
    assert sleeper.wait(10) == -9  # killed by the teardown, not left running in a deleted namespace
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert (
        subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout.count(
            lan.client_ip
        )
        == 0
    )
