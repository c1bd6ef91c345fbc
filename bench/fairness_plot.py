"""The plot of `duet bench fairness --plot PATH`: each team's output tokens per second over the
flood phase, fair shares beside first come first served (matplotlib, Agg: no display)."""

from __future__ import annotations

from pathlib import Path


def plot(timelines: dict[str, dict[str, list[int]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"fair": "fair shares (least attained service)", "fcfs": "first come first served"}
    fig, axes = plt.subplots(1, len(timelines), figsize=(11, 4), sharey=True)
    for ax, (name, teams) in zip(axes, timelines.items(), strict=True):
        for team, label in (("a", "team a (flood)"), ("b", "team b (steady)")):
            xs = teams[team]
            ax.step(range(len(xs)), xs, where="post", label=label)
        ax.set_title(titles.get(name, name))
        ax.set_xlabel("seconds into the phase")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("output tokens served per second")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
