"""The plot of `python -m bench.rollout --plot PATH`: per phase, the new version's share of the
split and each version's attempts and failed attempts per second (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLOURS = {"v1": "tab:blue", "bad": "tab:red", "good": "tab:green"}


def plot(out: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    titles = {
        "bad": f"'bad' (fails {out['fail_fraction']:.0%}): rolled back by itself",
        "good": "'good': canary, steps, done",
    }
    for ax, name in zip(axes, ("bad", "good"), strict=True):
        ph = out[name]
        rows = ph["rows"]
        ts = [r["t"] - ph["started_s"] for r in rows]
        for v in ("v1", ph["to"]):
            ax.step(ts, [r[v][0] for r in rows], where="post", color=COLOURS[v], label=f"{v} /s")
            failed = [r[v][1] for r in rows]
            if any(failed):
                ax.bar(ts, failed, width=0.8, color=COLOURS[v], alpha=0.5, label=f"{v} failed /s")
        errs = [r["client_errors"] for r in rows]
        ax.plot(ts, errs, "k.", label=f"client errors /s (total {ph['client_errors']})")
        ax.set_xlabel("seconds since `duet rollout start`")
        ax.set_title(titles[name], fontsize=10)
        ax.grid(alpha=0.3)
        share = ax.twinx()
        share.step(ts, [r["share"] for r in rows], where="post", color="tab:orange", ls="--")
        share.set_ylim(0, 105)
        share.set_ylabel(f"{ph['to']}'s share of the split (%)", color="tab:orange")
        if ph["ended_s"] is not None:
            ax.axvline(ph["ended_s"] - ph["started_s"], color="grey", ls=":")
        ax.legend(fontsize=8, loc="center left")
    axes[0].set_ylabel("attempts per second (this gateway's)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
