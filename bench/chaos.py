"""`duet bench chaos`: the SRE's fault drill. Runs mixed load (interactive streams, non-streamed
requests, one batch job) against a `duet up` cluster — one it starts (`--up-config`,
`--up-arg`) or a running one (`--url` with its `--home`) — and injects the `--faults` classes,
each on its own schedule (`--CLASS-every` seconds, held `--CLASS-for` seconds):
- kill: SIGKILL a random process (etcd, coordinators, nodes; a gateway while two or more run,
  or with --kill-gateway), which `duet up` restarts;
- stop: SIGSTOP a random process, SIGCONT it after --stop-for (sockets open, nothing answers);
- partition, delay (--delay-ms ± --jitter-ms), loss (--loss-pct): between two processes of one
  pair class — gateway <-> coordinator, gateway <-> node, prefill <-> decode (the KV path),
  node <-> etcd, coordinator <-> etcd — with every process in a network namespace of its own
  (chaos starts `duet up --netns`, and removes the namespaces at the end, even on failure);
- etcd: one etcd member cut off, then a second (quorum lost), then both back ([etcd] members = 3);
- disk: the gateways' store file system (a small tmpfs of the cluster's own) filled for --disk-for;
- slowfs: the gateways' SQLite store slow to commit (--slowfs-commit-s each) for --slowfs-for.
Network, etcd and disk faults need root and a `duet up` this run starts.

Prints a table (or `--json`) and writes DIR/chaos.json and DIR/chaos.png:
- requests answered (tokens or a defined error; a stream cut after its first tokens, when its
  gateway died, is answered with tokens but not in full) and undefined (a connection error
  before any token, a hang, a stream without [DONE]); availability with full tokens; full
  answers whose text differs from the greedy reference taken before the first kill (undefined
  with --strict-text);
- per kill: how long until `duet up` had the process healthy again;
- KV blocks still held on every node once the load is over (should be 0);
- usage: the gateway's records matched one by one to the client's requests (bench/chaos_usage.py):
  each full answer billed once with its tokens, no request billed twice;
- the batch job's lines: each done exactly once;
- per fault class: the faults injected, and the requests sent while one was on: answered, with
  full tokens, defined errors by cause;
- chaos.png: availability and p99 TTFT over time, each fault's interval shaded.

Examples:
    duet bench chaos --up-config cluster.toml --duration 120 --kill-every 30
    duet bench chaos --up-config cluster.toml --duration 600 --faults kill,stop,partition,delay,loss
    duet bench chaos --url http://127.0.0.1:8000 --home ~/.cache/duet --duration 600 --kill-every 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from bench.chaos_batch import BatchResult, run_batch
from bench.chaos_faults import CLASSES, NETWORK, DiskTrap, FaultSpec, Injector
from bench.chaos_kill import KINDS, Killer
from bench.chaos_load import PROMPTS, Record, one_request, references
from bench.chaos_report import render, render_faults, summarise
from bench.chaos_usage import check, fetch_records
from bench.plots import plot_chaos
from runtime import netns
from runtime.ports import free_port


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="duet bench chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t = p.add_argument_group("target (one of)")
    t.add_argument(
        "--url",
        default=None,
        help="gateway root of a running `duet up` (give its --home to kill processes)",
    )
    t.add_argument(
        "--home",
        default=None,
        help="DUET_HOME of that `duet up` (default $DUET_HOME): its processes and dev key",
    )
    t.add_argument(
        "--up-config",
        default=None,
        metavar="cluster.toml",
        help="start `duet up --config FILE` in a fresh home",
    )
    t.add_argument(
        "--up-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra `duet up` flag when chaos starts it, repeatable (e.g. "
        "--up-arg=--model=/m/tiny)",
    )
    t.add_argument("--api-key", default=None, help="bearer key (default: the home's dev key)")
    t.add_argument(
        "--model", default=None, help="model to ask (default: the first the gateway lists)"
    )
    c = p.add_argument_group("chaos")
    c.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    c.add_argument(
        "--faults",
        default="kill",
        metavar="CLASSES",
        help=f"fault classes, comma-separated, of kill,{','.join(CLASSES)} (default kill)",
    )
    for cls, every, hold in FAULT_DEFAULTS:
        c.add_argument(
            f"--{cls}-every",
            type=float,
            default=every,
            metavar="S",
            help=f"seconds between two {cls} faults (default {every:g})",
        )
        c.add_argument(
            f"--{cls}-for",
            type=float,
            default=hold,
            metavar="S",
            help=f"seconds each {cls} fault lasts (default {hold:g})",
        )
    c.add_argument(
        "--delay-ms", type=float, default=100.0, help="delay fault: one way, ms (default 100)"
    )
    c.add_argument("--jitter-ms", type=float, default=20.0, help="delay fault: ± ms (default 20)")
    c.add_argument(
        "--loss-pct", type=float, default=5.0, help="loss fault: packets dropped, %% (default 5)"
    )
    c.add_argument(
        "--slowfs-commit-s",
        type=float,
        default=2.0,
        help="slowfs fault: how long each commit holds the store's write lock, s (default 2)",
    )
    c.add_argument(
        "--kill-every",
        type=float,
        default=30.0,
        help="seconds between kills; 0: no kills (default 30)",
    )
    c.add_argument(
        "--kill",
        default=DEFAULT_KILL,
        metavar="KINDS",
        help=f"kinds of process to kill, comma-separated, of {','.join(KINDS)} (default: all; the "
        "gateways only while two or more run, as with `duet up --gateways 2`)",
    )
    c.add_argument(
        "--kill-gateway",
        action="store_true",
        help="also kill the gateway (with one gateway: an outage)",
    )
    c.add_argument("--seed", type=int, default=0, help="random seed of the victims (default 0)")
    w = p.add_argument_group("load")
    w.add_argument(
        "--streams", type=int, default=4, help="interactive streaming clients (default 4)"
    )
    w.add_argument("--plain", type=int, default=1, help="non-streamed clients (default 1)")
    w.add_argument(
        "--batch-lines", type=int, default=16, help="lines of the batch job (default 16; 0: none)"
    )
    w.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default 32)")
    w.add_argument(
        "--strict-text",
        action="store_true",
        help="count a full answer whose greedy text differs from the reference as undefined "
        "(default: only counted; bf16 greedy is not batch-invariant)",
    )
    w.add_argument(
        "--request-timeout",
        type=float,
        default=60.0,
        help="a request past this is a hang (default 60)",
    )
    w.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="seconds after the load for killed processes to come back, held KV to be freed and "
        "the batch to end (default 60)",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--out",
        default="chaos-results",
        help="directory for chaos.json and chaos.png (default chaos-results)",
    )
    o.add_argument(
        "--json", action="store_true", help="print the summary as JSON instead of a table"
    )
    o.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds for a started `duet up` to be ready",
    )
    a = p.parse_args(argv)
    kinds = {k.strip() for k in a.kill.split(",") if k.strip()} | (
        {"gateway"} if a.kill_gateway else set()
    )
    if unknown := kinds - set(KINDS):
        p.error(f"--kill: unknown kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
    a.kinds = kinds
    a.gateways_when_several = a.kill == DEFAULT_KILL  # an explicit --kill list is taken as given
    a.classes = {f.strip() for f in a.faults.split(",") if f.strip()}
    if bad := a.classes - {"kill", *CLASSES}:
        p.error(f"--faults: unknown classes {sorted(bad)} (known: kill,{','.join(CLASSES)})")
    if "kill" not in a.classes:
        a.kill_every = 0.0
    if a.classes & {*NETWORK, "disk"} and a.url is not None:
        p.error("--faults with network, etcd or disk faults needs a duet up chaos starts itself")
    a.specs = [
        FaultSpec(
            kind=cls,
            every_s=getattr(a, f"{cls}_every"),
            for_s=getattr(a, f"{cls}_for"),
            delay_ms=a.delay_ms,
            jitter_ms=a.jitter_ms,
            loss_pct=a.loss_pct,
            commit_s=a.slowfs_commit_s,
        )
        for cls in CLASSES
        if cls in a.classes
    ]
    if any(f.every_s <= 0 or f.for_s <= 0 for f in a.specs):
        p.error("every --CLASS-every and --CLASS-for must be > 0")
    if a.slowfs_commit_s <= 0:
        p.error("--slowfs-commit-s must be > 0")
    if (a.url is None) == (a.up_config is None and not a.up_arg):
        p.error(
            "give --url (a running duet up) or --up-config/--up-arg (chaos starts one), not both "
            "or neither"
        )
    if (
        a.duration <= 0
        or a.kill_every < 0
        or a.streams < 0
        or a.plain < 0
        or a.streams + a.plain == 0
    ):
        p.error(
            "--duration must be > 0, --kill-every >= 0, and at least one stream or plain client"
        )
    return a


#: every kind but the gateway, which joins while two or more run (Killer.gateways_when_several)
DEFAULT_KILL = "etcd,coordinator,prefill,decode,both"
#: (class, every_s, for_s) defaults: a fault held well under the client's 60 s timeout and the
#: supervisor's liveness limit (a process stopped 60 s is killed and restarted; a gateway 10 s)
FAULT_DEFAULTS = (
    ("stop", 45.0, 15.0),
    ("partition", 40.0, 15.0),
    ("delay", 50.0, 20.0),
    ("loss", 50.0, 20.0),
    ("etcd", 90.0, 30.0),
    ("disk", 60.0, 20.0),
    ("slowfs", 60.0, 20.0),
)


def _say(msg: str) -> None:
    print(f"chaos: {msg}", file=sys.stderr, flush=True)


class StartedUp:
    """A `duet up` this run started, in its own temporary home; stopped (SIGTERM, then SIGKILL)
    at the end, its process logs moved to OUT/logs and the home deleted."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="duet-chaos-"))
        self.out = out
        self.port = free_port()
        flags = ["--config", args.up_config] if args.up_config else []
        #: the namespaces' prefix (network faults): short, since `{prefix}r` names an interface
        self.prefix = f"dc{os.getpid() % 100000:05d}" if args.classes & NETWORK else None
        if self.prefix is not None:
            if why := netns.refused():
                raise RuntimeError(f"--faults {','.join(sorted(args.classes & NETWORK))}: {why}")
            flags += ["--netns", self.prefix]
        self.disk = DiskTrap(self.home) if "disk" in args.classes else None
        self.log = out / "up.log"
        env = {**os.environ, "DUET_HOME": str(self.home)}
        self._log = self.log.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "duet",
                "up",
                "--port",
                str(self.port),
                "--quiet",
                *flags,
                *args.up_arg,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = self.home / "up" / "state.json"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"duet up exited with {self.proc.returncode}; see {self.log}")
            with contextlib.suppress(FileNotFoundError, ValueError):
                if json.loads(state.read_text()).get("ready"):
                    return
            time.sleep(0.5)  # readiness polling interval
        raise RuntimeError(f"duet up not ready after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        if self.prefix is not None and (left := netns.destroy(self.prefix)):
            _say(f"removed what duet up left of its namespaces: {', '.join(left)}")
        logs = self.out / "logs"
        shutil.rmtree(logs, ignore_errors=True)
        with contextlib.suppress(OSError):
            shutil.copytree(self.home / "logs", logs)
        if self.disk is not None:
            self.disk.close()
        shutil.rmtree(self.home, ignore_errors=True)


def _get(url: str, key: str | None = None, timeout: float = 10.0) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def kv_held(state: dict[str, Any]) -> dict[str, int] | None:
    """Blocks in use per node (total − free), from any coordinator replica that answers."""
    secret = Path(state["home"]) / "up" / "cluster.secret" if state.get("home") else None
    key = (
        secret.read_text().strip() if secret is not None and secret.exists() else None
    )  # duet up's
    for url in state.get("coordinators", []):
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError, KeyError):
            nodes = _get(url + "/cluster", key)["nodes"]
            return {
                n["node_id"]: n["load"]["kv_blocks_total"] - n["load"]["kv_blocks_free"]
                for n in nodes
                if n.get("load")
            }
    return None


def usage_since(url: str, key: str, start: float) -> dict[str, Any]:
    """The gateway's usage totals since `start` (unix seconds); {"error": ...} if it cannot say."""
    try:
        rows = _get(f"{url}/v1/usage?start={start:.3f}", key)["data"]
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        return {"error": f"usage not readable: {e}"}
    return {f: sum(r[f] for r in rows) for f in ("requests", "prompt_tokens", "completion_tokens")}


async def _client(
    session: aiohttp.ClientSession,
    a: argparse.Namespace,
    url: str,
    key: str,
    model: str,
    kind: str,
    n: int,
    refs: dict[int, Any],
    t0: float,
    records: list[Record],
) -> None:
    i = n
    while time.monotonic() - t0 < a.duration:
        prompt = i % len(PROMPTS)
        rec = await one_request(
            session,
            url,
            key,
            model,
            kind,
            prompt,
            a.max_tokens,
            refs[prompt],
            t0,
            a.request_timeout,
            a.strict_text,
            tag=f"chaos-{kind}-{n}-{i}",
        )
        records.append(rec)
        i += 1
        if rec.outcome != "full" and rec.end_s - rec.sent_s < 0.05:
            await asyncio.sleep(0.05)  # an instant refusal (gateway down): do not spin


async def run(
    a: argparse.Namespace, url: str, key: str, home: Path | None, disk: DiskTrap | None = None
) -> dict[str, Any]:
    state_file = home / "up" / "state.json" if home else None
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        model = a.model or (await _models(session, url, key))[0]
        _say(f"model {model}: greedy references of {len(PROMPTS)} prompts")
        refs = await references(session, url, key, model, a.max_tokens, a.request_timeout)
        start_wall, t0 = time.time(), time.monotonic()
        records: list[Record] = []
        killer = (
            Killer(
                state_file,
                a.kinds,
                a.kill_every if state_file else 0,
                a.seed,
                t0,
                _say,
                gateways_when_several=a.gateways_when_several,
            )
            if state_file
            else None
        )
        _say(
            f"{a.duration:.0f} s of load: {a.streams} stream + {a.plain} plain clients, batch of "
            f"{a.batch_lines}"
            + (
                f"; SIGKILL every {a.kill_every:.0f} s among {sorted(a.kinds)}"
                if killer and a.kill_every
                else ""
            )
        )
        batch = asyncio.ensure_future(
            run_batch(
                session, url, key, model, a.batch_lines, a.max_tokens, t0 + a.duration + a.settle
            )
        )
        clients = [
            _client(session, a, url, key, model, "stream", i, refs, t0, records)
            for i in range(a.streams)
        ]
        clients += [
            _client(session, a, url, key, model, "plain", i, refs, t0, records)
            for i in range(a.plain)
        ]
        injector = (
            Injector(state_file, a.specs, a.seed, t0, _say, disk)
            if state_file and a.specs
            else None
        )
        try:
            await asyncio.gather(
                *clients,
                killer.run(a.duration) if killer else asyncio.sleep(0),
                injector.run(a.duration) if injector else asyncio.sleep(0),
            )
        finally:
            if injector is not None:
                await asyncio.to_thread(injector.settle)
        _say(f"load over: {len(records)} requests; settling (killed processes, held KV, the batch)")
        if killer:
            await killer.settle(a.settle)
        batch_res: BatchResult = await batch
        held: dict[str, int] | None = None
        if state_file:
            deadline = time.monotonic() + a.settle
            while time.monotonic() < deadline:  # P holds blocks for a pull until its lease ends
                st = json.loads(state_file.read_text())
                held = await asyncio.to_thread(kv_held, st)
                if held is not None and not any(held.values()):
                    break
                await asyncio.sleep(1.0)
        usage = await asyncio.to_thread(usage_since, url, key, start_wall)
        rows = await asyncio.to_thread(fetch_records, url, key, start_wall)
    return summarise(
        records,
        killer.kills if killer else [],
        batch_res,
        held or {},
        usage,
        a.duration,
        max(5.0, a.duration / 60),
        check(records, batch_res, rows),
        injector.events if injector else [],
    )


async def _models(session: aiohttp.ClientSession, url: str, key: str) -> list[str]:
    async with session.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
        return [m["id"] for m in (await r.json())["data"]]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    up: StartedUp | None = None
    try:
        if a.url is None:
            up = StartedUp(a, out)
            _say(f"starting duet up (home {up.home}, log {up.log})")
            if up.prefix is not None:
                _say(f"its processes in network namespaces {up.prefix}-*")
            up.wait_ready(a.startup_timeout)
            home = up.home
            # the gateway's address: loopback, or its namespace's (--netns)
            url = json.loads((home / "up" / "state.json").read_text())["gateway"]
        else:
            home = Path(
                a.home or os.environ.get("DUET_HOME") or Path.home() / ".cache" / "duet"
            ).expanduser()
            url = a.url.rstrip("/")
            if not (home / "up" / "state.json").exists():
                if a.kill_every:
                    _say(
                        f"no running duet up in {home}: nothing to kill (give --home, or "
                        "--kill-every 0)"
                    )
                    return 2
                home = None
        key = a.api_key or (home and (home / "up" / "dev.key").read_text().strip())
        if not key:
            _say("no API key: give --api-key")
            return 2
        summary = asyncio.run(run(a, url, key, home, up.disk if up else None))
    except RuntimeError as e:
        _say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    finally:
        if up is not None:
            _say("stopping the duet up it started")
            up.stop()
    (out / "chaos.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=2))
    png = plot_chaos(summary, out / "chaos.png")
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        render(summary)
        render_faults(summary)
        print(f"wrote {out / 'chaos.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
