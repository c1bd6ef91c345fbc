"""The Cluster page's autoscaler part: the leading coordinator's `GET /planner`
(protocol/planner.py) as two tables — the pools as the last tick saw them, and the recent
decisions with their reason, from → to, the figures they used and the actuator's answer.

Read like the rest of the page: from the coordinator replicas the gateway already knows, with
the cluster secret, never from etcd. The leader decides, so its report is the one shown (a
follower's holds only what it decided while it led).
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import msgspec

from gateway.console.render import esc, notice, table
from gateway.state import GatewayState
from protocol.planner import DecisionInputs, PlannerDecision, PlannerReport

_TIMEOUT = aiohttp.ClientTimeout(total=3)
_DECODE = msgspec.json.Decoder(PlannerReport)
#: decisions shown (the replica keeps more; /planner serves them all)
SHOWN = 30


class PlannerOff(Exception):
    """The replica runs no planner (404 planner_off)."""


async def fetch(state: GatewayState, url: str) -> PlannerReport:
    """`url`'s report; PlannerOff, or OSError/ValueError family errors the caller shows."""
    async with state.session.get(
        url + "/planner", timeout=_TIMEOUT, headers=state.config.security.headers
    ) as r:
        body = await r.read()
        if r.status == 404:
            raise PlannerOff()
        if r.status != 200:
            raise ValueError(f"HTTP {r.status}")
    return _DECODE.decode(body)


def _s(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def describe_inputs(i: DecisionInputs) -> str:
    """The figures of a decision in a line an operator reads (the JSON has them all)."""
    parts = [f"{i.replicas} replica{'' if i.replicas == 1 else 's'} ({i.warm} warm)"]
    if i.bounds is not None:
        parts.append(f"bounds {i.bounds[0]}–{i.bounds[1]}")
    if i.target is not None:
        parts.append(f"forecast wants {i.target}")
    if i.load is not None:
        parts.append(
            f"load {i.load.running:g} running, {i.load.waiting:g} waiting, "
            f"{i.load.queued_prefill_tokens:g} prompt tokens queued, KV {100 * i.load.kv_sum:.0f}%"
            f"{'' if i.load.busy_sum is None else f', busy {i.load.busy_sum:.2f} nodes'}"
        )
    if i.at_n is not None:
        slo = f" (SLO {_s(i.slo.ttft_s)} / {_s(i.slo.itl_s)})" if i.slo is not None else ""
        parts.append(
            f"predicted TTFT {_s(i.at_n.ttft_s)}, ITL {_s(i.at_n.itl_s)} at {i.at_n.n}{slo}"
        )
    if i.measured is not None:
        m = i.measured
        # the pool's quantile of its nodes' histograms; older nodes' P90s are weighted in (say so)
        figs = [
            f"{name} P90 {_s(p90)} ({n} "
            f"samples{'' if merged in (0, n) else f', {n - merged} as node P90s'})"
            for name, p90, n, merged in (
                ("TTFT", m.ttft_p90_s, m.ttft_samples, m.ttft_merged_samples),
                ("ITL", m.itl_p90_s, m.itl_samples, m.itl_merged_samples),
            )
            if n
        ]
        parts.append(
            f"measured {', '.join(figs)}, "
            f"{'counted: ' + '/'.join(m.counted) if m.counted else 'not counted'}"
        )
    if i.at_n_minus_1 is not None:
        less = i.at_n_minus_1
        busy = "" if less.busy is None else f", {100 * less.busy:.0f}% busy each"
        parts.append(f"at {less.n}: TTFT {_s(less.ttft_s)}, ITL {_s(less.itl_s)}{busy}")
    if i.budget is not None:
        parts.append(f"node budget {i.budget.total}/{i.budget.limit}")
    if i.blocked:
        parts.append(f"blocked step: {i.blocked}")
    return "; ".join(parts)


def _step(d: PlannerDecision) -> str:
    return {"out": "scale out", "in": "scale in"}.get(d.direction, "hold")


def _outcome(d: PlannerDecision) -> str:
    if d.direction == "hold":
        return "-"
    if d.outcome is None:
        return "in progress"
    return f"{d.outcome}: {d.detail}" if d.detail else d.outcome


def render(report: PlannerReport, url: str) -> str:
    last = (
        "never"
        if report.last_tick is None
        else f"{max(0.0, time.time() - report.last_tick):.0f} s ago"
    )
    lead = "leads" if report.is_leader else "does not lead (only the leader decides)"
    intro = (
        f'<p class="autoscaler">Autoscaler: <strong>{esc(report.mode)}</strong> mode, '
        f"<strong>{esc(report.actuator)}</strong> actuator, every {report.interval_s:g} s; "
        f"last decided {esc(last)} on {esc(report.replica_id)} ({esc(url)}), which {esc(lead)}."
        + (
            f" It decides nothing until its actuator can act: {esc(report.waiting)}."
            if report.waiting
            else ""
        )
        + "</p>"
    )
    pools = table(
        "Autoscaler pools",
        ["Pool", "Replicas", "Wanted", "Last tick"],
        [
            [
                f"{p.role}/{p.model}/{p.tier}",
                p.current,
                p.desired,
                p.reason if p.direction == "hold" else f"{p.direction} ({p.reason})",
            ]
            for p in sorted(report.pools, key=lambda p: (p.role, p.model, p.tier))
        ],
    )
    rows = [
        [
            time.strftime("%H:%M:%S", time.gmtime(d.at)),
            f"{d.role}/{d.model}/{d.tier}",
            _step(d),
            d.reason,
            f"{d.current} → {d.desired}",
            d.victim or "-",
            _outcome(d),
            describe_inputs(d.inputs),
        ]
        for d in report.decisions[:SHOWN]
    ]
    decisions = table(
        "Autoscaler decisions",
        ["Time (UTC)", "Pool", "Step", "Reason", "Replicas", "Node drained", "Outcome", "Inputs"],
        rows,
        body_id="planner-decisions",
    )
    return intro + pools + decisions


async def section(state: GatewayState, urls: list[str], reports: list[dict[str, Any] | str]) -> str:
    """The autoscaler part of the Cluster page: the leader's report (else the first replica that
    has one), or why there is none."""
    leaders = [
        u for u, r in zip(urls, reports, strict=True) if isinstance(r, dict) and r.get("is_leader")
    ]
    errors = []
    off = 0
    for url in leaders + [u for u in urls if u not in leaders]:
        try:
            return render(await fetch(state, url), url)
        except PlannerOff:
            off += 1
        except (aiohttp.ClientError, TimeoutError, ValueError, msgspec.DecodeError) as e:
            errors.append(f"{url}: {type(e).__name__}: {e}")
    if errors:
        return notice(
            "Autoscaler: cannot read the coordinator's decisions (" + "; ".join(errors) + ").",
            "error",
        )
    if off:
        return notice(
            "Autoscaler: off (start the coordinator with --planner load or --planner throughput to "
            "size the pools; docs/autoscaling.md)."
        )
    return ""
