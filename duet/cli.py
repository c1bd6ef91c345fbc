"""`duet` CLI: one argparse tree, one module per command family.

Each subcommand module exposes `add_parser(subparsers)` and sets `func` on its parser; `main`
dispatches to it and turns the errors operators cause (a model that is not pulled, a bad flag
value) into one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from duet import (
    cmd_bench,
    cmd_coordinator,
    cmd_gateway,
    cmd_models,
    cmd_nodes,
    cmd_plan,
    cmd_rollout,
    cmd_status,
    cmd_up,
)
from duet.errors import UsageError
from runtime.models import ModelNotFoundError

DESCRIPTION = """\
duet: disaggregated prefill/decode LLM serving.

Start everything on this machine:   duet up          (then: duet status)
Fetch the default model:            duet models pull
Run role-specific processes:        duet prefill | duet decode | duet node --role both
Run the control plane:              duet coordinator --etcd URL   (drain a node: duet drain NODE_ID;
                                    undo it: duet drain --undo NODE_ID)
Serve the OpenAI API:               duet gateway --config gateway.toml
Teams, keys and usage:              duet teams | duet keys | duet usage report
Load-test and measure:              duet bench engine | kvtransfer | pd | serve | profile
Plan capacity and cost:             duet plan
Roll a model to a new version:      duet rollout start MODEL --to VERSION (status, rollback)
"""


#: the commands that run a process `--trace` turns tracing on in (docs/console.md)
TRACED = ("up", "gateway", "coordinator", "prefill", "decode", "node")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="duet", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    cmd_models.add_parser(sub)
    cmd_nodes.add_parsers(sub)
    cmd_up.add_parser(sub)
    cmd_status.add_parser(sub)
    cmd_coordinator.add_parsers(sub)
    cmd_gateway.add_parsers(sub)
    cmd_bench.add_parser(sub)
    cmd_plan.add_parser(sub)
    cmd_rollout.add_parser(sub)
    for name in TRACED:  # one flag for every process kind (read in main)
        sub.choices[name].add_argument(
            "--trace",
            action="store_true",
            help="OpenTelemetry tracing on (as DUET_TRACING=1): spans go to "
            "$OTEL_EXPORTER_OTLP_ENDPOINT when set"
            + (", in every process it starts" if name == "up" else ""),
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(
        args, "trace", False
    ):  # runtime/tracing/config.py reads it; `duet up`'s children inherit it
        os.environ["DUET_TRACING"] = "1"
    try:
        return int(args.func(args) or 0)
    except (ModelNotFoundError, UsageError) as e:
        print(f"duet {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
