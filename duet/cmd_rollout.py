"""`duet rollout`: move a versioned model's requests to a new version, step by step, through the
gateway's admin API (protocol/rollout.py; the admin key: `$DUET_ADMIN_KEY` or --admin-key).

    duet rollout status MODEL                      weights, per-version outcomes, the rollout
    duet rollout start MODEL --to v2 --canary 5    v2 at 5 %, then the policy's steps above it
    duet rollout pause MODEL | resume MODEL        hold the split where it is / go on stepping
    duet rollout rollback MODEL                    every request back on the old version now
    duet rollout set MODEL v1=90 v2=10             weights by hand (a running rollout pauses)

The policy ([models.MODEL.rollout] in gateway.toml: steps, step_interval_s, window_s,
max_error_rate, max_ttft_p90_ratio, max_itl_p90_ratio, min_requests) steps the new version up
once each step has lasted step_interval_s with at least min_requests attempts on it in the
window, and rolls it back to 0 % by itself when its error rate (or its TTFT or inter-token
latency P90 against the old version's) crosses the bar. Weights and rollouts live in each
gateway process, and a restart serves the configured weights again: with several gateways,
each gets the command (each judges its own requests). Without --gateway, the running `duet
up`'s gateways are found in $DUET_HOME/up/state.json (each on its own port) and its admin key in
$DUET_HOME/up/admin.key. Make a finished rollout last by writing its weights into gateway.toml.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

import msgspec

from duet.errors import UsageError
from protocol.rollout import VersionsView

ACTIONS = ("status", "start", "pause", "resume", "rollback", "set")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rollout",
        help="roll a model out to a new version: canary, steps, automatic rollback",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", choices=ACTIONS, help="what to do (see above)")
    p.add_argument("model", help="the gateway's model name (a model with [versions])")
    p.add_argument("weights", nargs="*", metavar="VERSION=WEIGHT", help="set: the new weights")
    p.add_argument("--to", default=None, metavar="VERSION", help="start: the version to roll out")
    p.add_argument(
        "--canary",
        type=float,
        default=None,
        metavar="PERCENT",
        help="start: the new version's first share, percent (default: the policy's first step)",
    )
    p.add_argument(
        "--gateway",
        default=None,
        metavar="URL[,URL]",
        help="the gateway(s) to act on, each in turn (default: every gateway of the running "
        "`duet up`, each on its own port)",
    )
    p.add_argument(
        "--admin-key",
        default=None,
        help="the gateway's admin key (default: $DUET_ADMIN_KEY, else the running `duet up`'s)",
    )
    p.add_argument("--timeout-s", type=float, default=10.0, help="seconds per gateway call")
    p.add_argument("--json", action="store_true", help="print each gateway's answer as JSON")
    p.set_defaults(func=_run)


def _request(args: argparse.Namespace) -> tuple[str, str, bytes | None]:
    """(method, path, body) of the action."""
    path = f"/admin/models/{args.model}/"
    if args.action == "status":
        return "GET", path + "versions", None
    if args.action == "set":
        weights = {}
        for item in args.weights:
            name, eq, value = item.partition("=")
            try:
                weights[name] = float(value) if eq else float("nan")
            except ValueError:
                raise UsageError(f"weight {item!r}: VERSION=NUMBER, e.g. v2=10") from None
        if not weights or any(w != w for w in weights.values()):
            raise UsageError("set needs VERSION=WEIGHT pairs, e.g. v1=90 v2=10")
        return "PUT", path + "versions", msgspec.json.encode({"weights": weights})
    if args.action == "start" and args.to is None:
        raise UsageError("start needs --to VERSION")
    body = {"action": args.action, "to": args.to, "canary": args.canary}
    return "POST", path + "rollout", msgspec.json.encode(body)


def _call(url: str, key: str, method: str, path: str, body: bytes | None, t: float) -> bytes:
    req = urllib.request.Request(url.rstrip("/") + path, data=body, method=method)
    req.add_header("Authorization", f"Bearer {key}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=t) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        raise UsageError(f"{url}: {e.code} {e.read().decode(errors='replace')[:500]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise UsageError(f"{url}: cannot reach the gateway ({e})") from None


def show(v: VersionsView) -> str:
    """The answer as an operator reads it."""
    r = v.rollout
    lines = [f"model {v.model}: rollout {r.phase}" + (f" ({r.reason})" if r.reason else "")]
    if r.new:
        steps = " -> ".join(f"{s:g}" for s in r.steps)
        lines.append(f"  {r.old} -> {r.new}: {r.new} at {r.share:.1f} % (steps {steps} %)")
    p = r.policy
    lines.append(
        f"  window {p.window_s:g} s, error bar {p.max_error_rate:.1%}, step every "
        f"{p.step_interval_s:g} s with >= {p.min_requests} attempts"
    )
    for s in v.versions:
        p90 = "-" if s.ttft_p90_s is None else f"{s.ttft_p90_s * 1e3:.0f} ms"
        itl = "-" if s.itl_p90_s is None else f"{s.itl_p90_s * 1e3:.1f} ms"
        lines.append(
            f"  {s.name:<12} weight {s.weight:>6g}  {s.attempts:>6} attempts  "
            f"{s.failed:>5} failed  TTFT P90 {p90}  ITL P90 {itl}  ({s.served_name})"
        )
    for e in r.events[-5:]:
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e.at))} {e.what}")
    return "\n".join(lines)


def _up_gateways() -> tuple[list[str], str | None]:
    """The running `duet up`'s gateways (each process's own URL) and its admin key."""
    from duet.up_home import UpHome, read_secret

    home = UpHome.current()
    state = home.read_state()
    if state is None:
        raise UsageError("no running `duet up` found ($DUET_HOME/up/state.json): pass --gateway")
    urls = [
        str(c["url"])
        for c in state.get("children", [])
        if str(c.get("name", "")).startswith("gateway") and c.get("url")
    ]
    if not urls:
        raise UsageError("the running `duet up` lists no gateway: pass --gateway")
    return urls, read_secret(home.admin_key_file)


def _run(args: argparse.Namespace) -> int:
    if args.gateway is not None:
        urls, up_key = [u for u in args.gateway.split(",") if u], None
    else:
        urls, up_key = _up_gateways()
    key = args.admin_key or os.environ.get("DUET_ADMIN_KEY") or up_key
    if not key:
        raise UsageError("no admin key: set $DUET_ADMIN_KEY or pass --admin-key")
    method, path, body = _request(args)
    for url in urls:
        raw = _call(url, key, method, path, body, args.timeout_s)
        view = msgspec.json.decode(raw, type=VersionsView)
        if args.json:
            print(json.dumps({"gateway": url, **msgspec.to_builtins(view)}))
        else:
            print(f"{url}\n{show(view)}")
    sys.stdout.flush()
    return 0
