"""Subcommands whose issues have not landed yet: they say so and exit 2, never pretend."""

from __future__ import annotations

import argparse
import sys

PENDING = {
    "coordinator": (
        "etcd-backed coordinator: node registry, prefix index, /route",
        "the coordinator issue",
    ),
}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, (what, where) in PENDING.items():
        p = sub.add_parser(name, help=f"{what} (not implemented yet)",
                           description=f"{what}. Not implemented yet: arrives with {where}.")  # fmt: skip
        p.set_defaults(func=_pending(name, where))


def _pending(name: str, where: str):
    def run(_: argparse.Namespace) -> int:
        print(f"duet {name}: not implemented yet (arrives with {where})", file=sys.stderr)
        return 2

    return run
