"""PNG plots of a plan (matplotlib, Agg): the Pareto front of fleet cost against TTFT P90, $ per
1M tokens against mean utilisation beside the commercial prices, and the chosen cell's queue
depth and KV use over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from sim.plan import Fleet
from sim.prices import CommercialPrice


def _ttft(fleets: list[Fleet]) -> list[tuple[float, float]]:
    """(USD an hour, p90 TTFT) of each fleet whose run measured a TTFT (one that answered
    nothing has none to plot)."""
    return [
        (f.usd_per_hour, t) for f in fleets if (t := f.summary.latency_ms["p90_ttft"]) is not None
    ]


def pareto(points: list[Fleet], front: list[Fleet], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in sorted({f.profile for f in points}):
        mine = _ttft([f for f in points if f.profile == name and f.summary.meets_slo])
        ax.scatter(
            [usd for usd, _ in mine],
            [ttft for _, ttft in mine],
            label=name,
            alpha=0.6,
        )
    on_front = _ttft(front)
    ax.plot(
        [usd for usd, _ in on_front],
        [ttft for _, ttft in on_front],
        "k--",
        label="Pareto front",
    )
    for f in front:
        ax.annotate(f.variant, (f.usd_per_hour, f.summary.latency_ms["p90_ttft"]), fontsize=7)
    ax.set_xlabel("fleet cost at the peak ($/hour)")
    ax.set_ylabel("predicted TTFT P90 (ms)")
    ax.set_title("Fleets meeting the SLOs: cost vs TTFT")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cost_vs_utilisation(
    fleets: list[tuple[str, Fleet]],
    prices: list[CommercialPrice],
    tokens: tuple[float, float],
    required_saving: float,
    path: Path,
) -> Path:
    i, o = tokens
    us = [u / 100 for u in range(5, 101)]
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, f in fleets:
        ax.plot([u * 100 for u in us], [f.usd_per_m_tokens(u, i + o) for u in us], label=label)
    for p in prices:
        blended = p.cost(i, o) / (i + o) * 1e6
        ax.axhline(blended * (1 - required_saving), ls=":", lw=1, color="gray")
        ax.text(
            101,
            blended * (1 - required_saving),
            f"{p.model} −{required_saving:.0%}",
            fontsize=7,
            va="center",
        )
    ax.set_yscale("log")
    ax.set_xlabel("mean load as % of the fleet's SLO capacity")
    ax.set_ylabel("$ per 1M tokens (input + output)")
    ax.set_title("Self-hosted cost per token vs commercial prices less the required saving")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline(tl: dict[str, list[float]], title: str, path: Path) -> Path:
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    a.plot(tl["t"], tl["node_waiting"], label="waiting on nodes")
    a.plot(tl["t"], tl["node_running"], label="running on nodes")
    a.plot(tl["t"], tl["gateway_queue"], label="gateway queue")
    a.legend(fontsize=7)
    a.set_ylabel("requests")
    b.plot(tl["t"], [x * 100 for x in tl["kv_usage"]])
    b.set_ylabel("KV use (%)")
    b.set_xlabel("simulated time (s)")
    a.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
