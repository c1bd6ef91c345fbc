"""`duet prefill`, `duet decode`, `duet node`: the node roles (filled in by the nodes issue)."""

from __future__ import annotations

import argparse
import sys


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, what in (
        ("prefill", "prefill node: prompts → KV blocks held for decode nodes"),
        ("decode", "decode node: pulls KV blocks and streams tokens"),
        ("node", "a node of any role (--role prefill|decode|both)"),
        ("up", "start the whole system on this machine"),
    ):
        p = sub.add_parser(name, help=f"{what} (not implemented yet)",
                           description=f"{what}. Not implemented yet.")  # fmt: skip
        p.set_defaults(func=_pending(name))


def _pending(name: str):
    def run(_: argparse.Namespace) -> int:
        print(f"duet {name}: not implemented yet (arrives with the nodes issue)", file=sys.stderr)
        return 2

    return run
