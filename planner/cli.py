"""The planner's flags on `duet coordinator`, and building it from them (the composition root
calls `add_args` and `from_args`; nothing here runs unless `--planner` is given)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from planner.config import PlannerMode, StepCost, load_config
from runtime.plane import PlaneSecurity

log = logging.getLogger("duet.planner")


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planner (autoscaling; runs only while this replica leads)")
    g.add_argument(
        "--planner",
        choices=["off", *[m.value for m in PlannerMode]],
        default="off",
        help="load: react to queues, KV use and predicted TTFT/ITL against the tier's SLO; throughput: "
        "size for the forecast request rate on the simulator (needs a profile)",
    )
    g.add_argument(
        "--planner-config",
        default=None,
        metavar="planner.toml",
        help="SLOs, bounds, budget, pacing (see planner/config.py); the flags below override it",
    )
    g.add_argument(
        "--actuator",
        choices=["virtual", "kubernetes", "local"],
        default="virtual",
        help="virtual: write the decision to --decision-file for an external scaler; kubernetes: resize "
        "the P/D Deployments; local: ask `duet up` (--local-control) to start or stop nodes",
    )
    g.add_argument(
        "--decision-file", default="planner-decision.json", help="virtual actuator: where to write"
    )
    g.add_argument(
        "--k8s-namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="kubernetes actuator: the namespace of the P/D Deployments",
    )
    g.add_argument(
        "--k8s-deployment",
        action="append",
        default=[],
        metavar="POOL=NAME",
        help="kubernetes actuator: the Deployment of a pool (role, role/tier or role/model/tier), "
        "repeatable; default duet-ROLE[-TIER]",
    )
    g.add_argument(
        "--local-control", default=None, metavar="URL", help="local actuator: duet up's control URL"
    )
    g.add_argument(
        "--node-budget", type=int, default=None, help="most nodes across every pool and model"
    )
    g.add_argument(
        "--planner-profile",
        default=None,
        metavar="PROFILE.json",
        help="node profile (duet bench profile): the load mode's step cost, the throughput mode's model",
    )
    g.add_argument(
        "--drain-deadline-s",
        type=float,
        default=120.0,
        help="scale-in: how long a node may take to finish its work before it is stopped anyway "
        "(its streams then migrate)",
    )


def from_args(
    args: argparse.Namespace, security: PlaneSecurity
) -> Callable[[Any], Awaitable[None]] | None:
    """The planner as a coordinator background task, or None with `--planner off`. Raises
    ValueError on a bad configuration (the CLI turns it into a usage error). `security`: the
    coordinator's own plane settings — the drains go out with its cluster secret and trust its
    `--tls-ca` (a node's /drain refuses a request without the secret, and a TLS node's
    certificate may come from a private CA)."""
    if args.planner == "off":
        return None
    cfg = load_config(
        args.planner_config,
        mode=args.planner,
        node_budget=args.node_budget,
        profile=args.planner_profile,
    )
    if cfg.mode == PlannerMode.THROUGHPUT and not cfg.profile:
        raise ValueError(
            "--planner throughput needs a node profile (--planner-profile or profile = in the config)"
        )
    if not cfg.profile and cfg.step == StepCost():
        # load mode predicts TTFT/ITL from these: right for a small CPU node, wrong by orders of
        # magnitude for a GPU one — the operator must hear it, not find out from a bad step
        log.warning(
            "planner: no node profile and no [planner.step]: TTFT/ITL are predicted with the default "
            "step cost (SmolLM2-135M on one CPU thread); give --planner-profile PROFILE.json "
            "(duet bench profile, or data/profiles/) for any other node kind"
        )
    if args.actuator == "local" and not args.local_control:
        raise ValueError(
            "--actuator local needs --local-control URL (duet up --autoscale passes it)"
        )
    deployments = {}
    for item in args.k8s_deployment:
        pool, sep, name = item.partition("=")
        if not sep or not pool or not name:
            raise ValueError(
                f"--k8s-deployment wants POOL=NAME (e.g. decode/batch=duet-decode-batch), not {item!r}"
            )
        deployments[pool] = name

    async def run(coordinator: Any) -> None:
        from planner.drain import Drainer
        from planner.loop import PlannerLoop

        async with security.client_session() as session:
            drainer = Drainer(session, deadline_s=args.drain_deadline_s)
            actuator: Any
            if args.actuator == "kubernetes":
                from planner.kube import KubernetesActuator

                actuator = KubernetesActuator(args.k8s_namespace, drainer, deployments=deployments)
            elif args.actuator == "local":
                from planner.local import LocalActuator

                actuator = LocalActuator(args.local_control, drainer, session)
            else:
                from planner.virtual import VirtualActuator

                actuator = VirtualActuator(args.decision_file)
            sizer = None
            if cfg.mode == PlannerMode.THROUGHPUT:
                from planner.throughput import SimSizer

                sizer = SimSizer(cfg.profile or "", headroom=cfg.headroom)
            await PlannerLoop(coordinator, cfg, actuator, sizer=sizer).run()

    return run
