"""The planner's flags on `duet coordinator`, and building it from them (the composition root
calls `add_args` and `from_args`; nothing here runs unless the planner is turned on).

Its settings live in planner.toml (`--planner-config`); `--planner-set KEY=VALUE` sets one key
over the file's, and `--planner MODE` its mode (off: none). duet/cmd_coordinator.py keeps the
flags the settings once had as deprecated aliases of `--planner-set`."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

from planner.config import PlannerMode, StepCost, load_config
from runtime.plane import PlaneSecurity

log = logging.getLogger("duet.planner")


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "planner (autoscaling; runs only while this replica leads)",
        "Its settings are planner.toml's keys (planner/config.py, docs/autoscaling.md): mode,\n"
        "actuator, SLOs, bounds, node budget, pacing. It runs with --planner-config or --planner.",
    )
    g.add_argument(
        "--planner",
        choices=["off", *[m.value for m in PlannerMode]],
        default=None,
        help="the planner's mode over planner.toml's `mode` (off: no planner). load: react to "
        "queues, KV use and predicted TTFT/ITL against the tier's SLO; throughput: size for "
        "the forecast request rate on the simulator (needs a profile)",
    )
    g.add_argument(
        "--planner-config",
        default=None,
        metavar="planner.toml",
        help="the planner's settings (planner/config.py); turns the planner on",
    )
    g.add_argument(
        "--planner-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one planner.toml key over the file's, repeatable: VALUE in TOML syntax (a text "
        "setting takes it as it is); KEY.NAME reaches into a table, e.g. "
        "k8s_deployments.decode=duet-decode-gpu or bounds.prefill=[1,3]",
    )


def from_args(
    args: argparse.Namespace, security: PlaneSecurity
) -> Callable[[Any], Coroutine[Any, Any, None]] | None:
    """The planner as a coordinator background task, or None when it is off. Raises
    ValueError on a bad configuration (the CLI turns it into a usage error). `security`: the
    coordinator's own plane settings — the drains go out with its cluster secret and trust its
    `--tls-ca` (a node's /drain refuses a request without the secret, and a TLS node's
    certificate may come from a private CA)."""
    given = args.planner_config or args.planner_set
    if args.planner == "off" or (args.planner is None and not given):
        return None
    cfg = load_config(args.planner_config, args.planner_set, mode=args.planner)
    if cfg.mode == PlannerMode.THROUGHPUT and not cfg.profile:
        raise ValueError(
            "the planner's throughput mode needs a node profile (profile = in planner.toml, or "
            "--planner-set profile=PROFILE.json)"
        )
    if not cfg.profile and cfg.step == StepCost():
        # load mode predicts TTFT/ITL from these: right for a small CPU node, wrong by orders of
        # magnitude for a GPU one — the operator must hear it, not find out from a bad step
        log.warning(
            "planner: no node profile and no [planner.step]: TTFT/ITL are predicted with the "
            "default step cost (SmolLM2-135M on one CPU thread); set profile = PROFILE.json in "
            "planner.toml (duet bench profile, or data/profiles/) for any other node kind"
        )
    if cfg.actuator == "local" and not cfg.local_control:
        raise ValueError(
            "the local actuator needs local_control = URL (duet up --autoscale sets it)"
        )
    namespace = cfg.k8s_namespace or os.environ.get("POD_NAMESPACE", "default")

    async def run(coordinator: Any) -> None:
        from planner.drain import Drainer
        from planner.loop import PlannerLoop

        async with security.client_session() as session:
            drainer = Drainer(
                session,
                deadline_s=cfg.drain_deadline_s,
                owner=f"planner/{coordinator.replica_id}",
            )
            actuator: Any
            if cfg.actuator == "kubernetes":
                from planner.kube import KubernetesActuator

                actuator = KubernetesActuator(
                    namespace, drainer, deployments=dict(cfg.k8s_deployments)
                )
            elif cfg.actuator == "local":
                from planner.local import LocalActuator

                actuator = LocalActuator(cfg.local_control or "", drainer, session)
            else:
                from planner.virtual import VirtualActuator

                actuator = VirtualActuator(cfg.decision_file)
            sizer = None
            if cfg.mode == PlannerMode.THROUGHPUT:
                from planner.throughput import SimSizer

                sizer = SimSizer(cfg.profile or "", headroom=cfg.headroom)
            await PlannerLoop(coordinator, cfg, actuator, sizer=sizer).run()

    return run
