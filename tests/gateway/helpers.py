"""Gateway processes for tests: a gateway.toml writer, `duet gateway` as a real process, and
admin calls (teams, keys) over HTTP with the admin key."""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.procs import Proc, free_port

ADMIN_KEY = "test-admin-key-0123456789-abcdefghijklmnop"
MODEL = "tiny"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def write_config(path: Path, models: dict[str, dict[str, Any]], **sections: dict[str, Any]) -> Path:
    lines = []
    for name, body in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    for name, body in models.items():
        # a name TOML's bare keys cannot spell (`base:adapter`) is quoted
        lines.append(
            f"[models.{name if re.fullmatch(r'[A-Za-z0-9_-]+', name) else json.dumps(name)}]"
        )
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_model(
    tokenizer: Path,
    prefill: list[str] = (),
    decode: list[str] = (),
    both: list[str] = (),
    **extra: Any,
) -> dict[str, Any]:
    static = {
        k: list(v) for k, v in (("prefill", prefill), ("decode", decode), ("both", both)) if v
    }
    return {
        "kind": "cluster",
        "tokenizer": str(tokenizer),
        "input_usd_per_mtok": 1.0,
        "output_usd_per_mtok": 2.0,
        "static": static,
        **extra,
    }


def gateway_proc(
    tmp: Path,
    models: dict[str, dict[str, Any]],
    port: int | None = None,
    store: Path | str | None = None,
    args: tuple[str, ...] = (),
    **sections: dict[str, Any],
) -> Proc:
    """`store`: an SQLite file (default tmp/gateway.db) or a postgresql:// URL; `args`: more
    `duet gateway` flags."""
    port = port or free_port()
    url = store if isinstance(store, str) else f"sqlite://{store or tmp / 'gateway.db'}"
    server = {**sections.pop("server", {}), "port": port}
    sections = {"server": server, "store": {"url": url}, **sections}
    cfg = write_config(tmp / f"gateway-{port}.toml", models, **sections)
    cmd = [
        sys.executable,
        "-m",
        "duet",
        "gateway",
        "--config",
        str(cfg),
        "--log-level",
        "INFO",
        *args,
    ]
    return Proc(cmd, port, tmp / f"gateway-{port}.log", env={"DUET_ADMIN_KEY": ADMIN_KEY})


def http(
    url: str,
    method: str = "GET",
    body: Any = None,
    key: str | None = ADMIN_KEY,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read()
            return r.status, dict(r.headers), json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text.decode(errors="replace")
        return e.code, dict(e.headers), parsed


def make_team(url: str, team: str, **limits: Any) -> str:
    """Create `team` with `limits` and one key; returns the key's secret."""
    status, _, body = http(f"{url}/admin/teams", "POST", {"id": team, **limits})
    assert status == 201, body
    status, _, body = http(f"{url}/admin/keys", "POST", {"team_id": team})
    assert status == 201, body
    assert body["key"].startswith("sk-duet-")
    return body["key"]


def scrape(url: str, admin_key: str = ADMIN_KEY) -> str:
    """A node's or gateway's /metrics, read with the admin key (a gateway's needs it by default;
    a node's open /metrics ignores it)."""
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {admin_key}"})
    return urllib.request.urlopen(req, timeout=10).read().decode()


def metric(url: str, name: str, admin_key: str = ADMIN_KEY) -> float:
    """Sum of a metric's samples (all label sets) on a node or gateway (`admin_key`: the
    gateway's, when it is not the tests' own, as under `duet up`)."""
    text = scrape(url, admin_key)
    return sum(
        float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    )
