"""`duet gateway`, and the operator commands on its store: `duet teams`, `duet keys`,
`duet usage report`.

The store commands open the same store the gateway uses (`--config gateway.toml`, or
`--store URL`) directly, so they work with the gateway down.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from coordinator.etcd_auth import add_etcd_arguments, apply_etcd_args
from duet.errors import UsageError
from duet.security_args import add_gateway_security_arguments, plane_security
from gateway.accounts.store.base import GROUP_BY  # msgspec only: cheap enough for the parser

GATEWAY_HELP = """\
OpenAI-compatible gateway: API keys, teams, quotas, tiers, routing to prefill/decode nodes.

Serves POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/usage,
GET /health, GET /metrics, and /admin/teams, /admin/keys (admin key: $DUET_ADMIN_KEY).
The batch tier ([batch] in gateway.toml, on by default): POST /v1/files, /v1/batches (OpenAI's
Files and Batches APIs) and POST /v1/batch, run in the background at the batch tier and price.
Models, prices, limits and the store are set in gateway.toml (see gateway/config.py).
"""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "gateway",
        help="OpenAI-compatible gateway: keys, teams, quotas, tiers, routing",
        description=GATEWAY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g.add_argument("--config", required=True, help="gateway.toml")
    g.add_argument(
        "--host", default=None, help="address to listen on (default: [server] host, 127.0.0.1)"
    )
    g.add_argument("--port", type=int, default=None, help="port (default: [server] port, 8000)")
    g.add_argument(
        "--coordinator",
        default=None,
        help="coordinator replica URLs, comma-separated (all of them)",
    )
    g.add_argument("--etcd", default=None, help="etcd endpoint to find coordinators and nodes from")
    add_etcd_arguments(g)
    _store_source_args(g, "overrides [store] url")
    g.add_argument("--log-level", default="INFO")
    add_gateway_security_arguments(g)
    g.set_defaults(func=_gateway)

    t = sub.add_parser(
        "teams", help="create, list and delete gateway teams (in the gateway's store)"
    )
    tsub = t.add_subparsers(dest="action", required=True, metavar="ACTION")
    tc = tsub.add_parser("create", help="create a team with its limits")
    tc.add_argument("team")
    for name, kind, what in (
        ("rpm", int, "requests per minute"),
        ("tpm", int, "tokens per minute"),
        ("max-concurrent", int, "requests in flight at once"),
        ("daily-budget", float, "USD per UTC day"),
        ("monthly-budget", float, "USD per month"),
    ):
        tc.add_argument(f"--{name}", type=kind, default=None, help=f"limit: {what} (default: none)")
    tc.add_argument("--default-tier", choices=["interactive", "batch"], default="interactive")
    tl = tsub.add_parser("list", help="list teams")
    td = tsub.add_parser("delete", help="delete a team and revoke its keys")
    td.add_argument("team")
    for p in (tc, tl, td):
        _store_args(p)
        p.set_defaults(func=_teams)

    k = sub.add_parser("keys", help="create, list and revoke API keys (in the gateway's store)")
    ksub = k.add_subparsers(dest="action", required=True, metavar="ACTION")
    kc = ksub.add_parser("create", help="create a key for a team; the secret is printed once")
    kc.add_argument("--team", required=True)
    kc.add_argument("--name", default="")
    kc.add_argument(
        "--create-team", action="store_true", help="create the team (no limits) if missing"
    )
    kl = ksub.add_parser("list", help="list keys (never their secrets)")
    kl.add_argument("--team", default=None)
    kr = ksub.add_parser("revoke", help="revoke a key by id")
    kr.add_argument("key_id")
    for p in (kc, kl, kr):
        _store_args(p)
        p.set_defaults(func=_keys)

    u = sub.add_parser("usage", help="usage reports from the gateway's store")
    usub = u.add_subparsers(dest="action", required=True, metavar="ACTION")
    ur = usub.add_parser(
        "report", help="usage records or totals for a day or a range, as CSV or JSON"
    )
    ur.add_argument("--date", default=None, help="YYYY-MM-DD (default: today, UTC)")
    ur.add_argument("--start", default=None, help="YYYY-MM-DD or unix seconds")
    ur.add_argument("--end", default=None, help="YYYY-MM-DD (inclusive) or unix seconds")
    ur.add_argument("--team", default=None, help="one team (default: all)")
    ur.add_argument(
        "--group-by",
        choices=[*GROUP_BY, "record"],
        default="record",
        help="totals per model/day/team/tier/user (the requests' OpenAI `user` field)/adapter "
        "(the LoRA adapter)/version (per model), each with its TTFT P50/P90, or every usage record",
    )
    ur.add_argument("--format", choices=["csv", "json"], default="csv")
    _store_args(ur)
    ur.set_defaults(func=_usage)


def _store_source_args(p: Any, default: str) -> None:
    """--store and --store-url-file; $DUET_STORE_URL after them (see `_store_override`)."""
    p.add_argument(
        "--store",
        default=None,
        help=f"sqlite:///PATH or postgresql://... ({default}). A DSN with a password belongs in "
        "--store-url-file or $DUET_STORE_URL: a command line is visible to every local user",
    )
    p.add_argument(
        "--store-url-file",
        default=None,
        metavar="PATH",
        help="read the store URL from this file (one line; e.g. a mounted Secret). Order: "
        "--store, --store-url-file, $DUET_STORE_URL, then the config's",
    )


def _store_override(args: argparse.Namespace) -> str | None:
    """The store URL given outside the config file: --store, --store-url-file, then
    $DUET_STORE_URL (the last two keep a DSN's password out of /proc/*/cmdline)."""
    if args.store:
        return str(args.store)
    if args.store_url_file:
        try:
            url = Path(args.store_url_file).read_text().strip()
        except OSError as e:
            raise UsageError(f"--store-url-file: {e}") from None
        if not url:
            raise UsageError(f"--store-url-file {args.store_url_file} is empty")
        return url
    return os.environ.get("DUET_STORE_URL", "").strip() or None


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="gateway.toml (its [store] url)")
    _store_source_args(p, "default: the config's, else sqlite under $DUET_HOME")


def _store_url(args: argparse.Namespace) -> str:
    from gateway.config import ConfigError, default_store_url, load_config

    if (url := _store_override(args)) is not None:
        return url
    if args.config:
        try:
            return load_config(args.config).store_url
        except ConfigError as e:
            raise UsageError(str(e)) from None
    return default_store_url()


def _config(args: argparse.Namespace):  # -> GatewayConfig
    from gateway.config import ConfigError, RoutingConfig, load_config
    from runtime.models import resolve_model

    try:
        cfg = load_config(args.config)
        apply_etcd_args(args)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None
    server = dataclasses.replace(
        cfg.server, **{k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    )
    routing: RoutingConfig = cfg.routing
    if args.coordinator:
        routing = dataclasses.replace(
            routing, coordinator=tuple(u.strip() for u in args.coordinator.split(",") if u.strip())
        )
    if args.etcd:
        routing = dataclasses.replace(routing, etcd=args.etcd)
    cfg = dataclasses.replace(
        cfg,
        server=server,
        routing=routing,
        store_url=_store_override(args) or cfg.store_url,
        security=plane_security(args),
    )
    from gateway.accounts.store import open_store

    try:
        open_store(cfg.store_url)  # checks the URL's form (connects only when the gateway starts)
    except (ValueError, ImportError) as e:
        raise UsageError(str(e)) from None
    for m in cfg.models.values():
        if m.kind == "external":
            try:
                import gateway.backends.providers  # noqa: F401  (another issue adds it)
            except ImportError:
                raise UsageError(
                    f"model {m.name!r} is external, but this gateway has no providers package"
                ) from None
        if m.kind == "cluster":
            # the config's checks refuse a cluster model without a tokenizer
            assert m.tokenizer is not None
            resolve_model(m.tokenizer)  # an unknown model is a one-line error before we listen
            if m.static is None and not routing.coordinator and not routing.etcd:
                raise UsageError(
                    f"model {m.name!r} has no static node list, and neither --coordinator nor "
                    "--etcd is given: nothing could serve it"
                )
    return cfg


def _gateway(args: argparse.Namespace) -> int:
    from gateway.server import run_gateway
    from node.request_log import setup_logging

    setup_logging(args.log_level, name="gateway")
    return run_gateway(_config(args))


async def _with_store(url: str, fn: Any) -> Any:
    from gateway.accounts.store import open_store

    store = open_store(url)
    await store.open()
    try:
        return await fn(store)
    finally:
        await store.close()


def _print(obj: Any) -> None:
    import msgspec

    print(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode())


def _teams(args: argparse.Namespace) -> int:
    from gateway.accounts.store.base import StoreError
    from gateway.api.admin_teams import TeamCreate, validate_team
    from protocol.openai import APIError

    async def run(store: Any) -> int:
        if args.action == "create":
            team = validate_team(
                TeamCreate(
                    id=args.team,
                    rpm=args.rpm,
                    tpm=args.tpm,
                    max_concurrent=args.max_concurrent,
                    daily_budget_usd=args.daily_budget,
                    monthly_budget_usd=args.monthly_budget,
                    default_tier=args.default_tier,
                )
            )
            _print(await store.create_team(team))
        elif args.action == "list":
            _print(await store.list_teams())
        elif not await store.delete_team(args.team):
            raise UsageError(f"no team {args.team!r}")
        return 0

    try:
        return asyncio.run(_with_store(_store_url(args), run))
    except (StoreError, APIError) as e:
        raise UsageError(str(e)) from None


def _keys(args: argparse.Namespace) -> int:
    from gateway.accounts.keys import new_key
    from gateway.accounts.store.base import StoreError, Team

    async def run(store: Any) -> int:
        if args.action == "create":
            if args.create_team and await store.get_team(args.team) is None:
                await store.create_team(Team(id=args.team))
            key, secret, digest = new_key(args.team, args.name)
            await store.create_key(key, digest)
            print(
                f"key id {key.id} for team {args.team} (the secret is shown only now):",
                file=sys.stderr,
            )
            print(secret)
        elif args.action == "list":
            _print(await store.list_keys(args.team))
        elif not await store.revoke_key(args.key_id):
            raise UsageError(f"no live key {args.key_id!r}")
        return 0

    try:
        return asyncio.run(_with_store(_store_url(args), run))
    except StoreError as e:
        raise UsageError(str(e)) from None


def _usage(args: argparse.Namespace) -> int:
    from gateway.api.admin import time_range
    from protocol.openai import APIError

    q = {k: v for k, v in (("date", args.date), ("start", args.start), ("end", args.end)) if v}
    try:
        start, end = time_range(q)
    except APIError as e:
        raise UsageError(e.message) from None

    async def run(store: Any) -> list[dict[str, Any]]:
        if args.group_by == "record":
            from gateway.api.admin import record_rows

            return record_rows(await store.usage_records(args.team, start, end))
        return await store.usage(args.team, start, end, args.group_by)

    rows = asyncio.run(_with_store(_store_url(args), run))
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    if rows:
        w = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return 0
