"""PNG plots of a run or a sweep (matplotlib, Agg: no display needed).

Run: `ttft_cdf.png`, `itl_cdf.png` (empirical CDFs, ms) and `throughput.png` (output tokens/s
and completions/s per second of the run). Sweep: the same for every run overlaid, plus
`latency_throughput.png` (p50/p99 TTFT and TPOT against achieved request throughput, SLO
lines when given). Returns the paths written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    x = np.sort(np.asarray(values_ms))
    ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=label)


def _runs_cdfs(runs: list[tuple[str, dict[str, Any]]], out: Path) -> list[Path]:
    plt = _plt()
    paths = []
    for key, name, title in (("ttfts", "ttft_cdf.png", "TTFT"), ("itls", "itl_cdf.png", "ITL")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, r in runs:
            vals = r[key]
            ms = (
                [v * 1e3 for v in vals if v is not None]
                if key == "ttfts"
                else [g * 1e3 for xs in vals for g in xs]
            )
            _cdf(ax, ms, label)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
        if any(label for label, _ in runs):
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, r in runs:
        tl = r["throughput_timeline"]
        ax.step(
            [p["t"] for p in tl],
            [p["output_tokens_per_s"] for p in tl],
            where="post",
            label=f"{label} tok/s".strip(),
        )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput over time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)
    paths.append(out / "throughput.png")
    return paths


def plot_run(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return _runs_cdfs([(result.get("label") or "", result)], out)


def plot_sweep(sweep: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    param = sweep["sweep"]["param"]
    runs = [
        (f"{param}={v}", r) for v, r in zip(sweep["sweep"]["values"], sweep["runs"], strict=True)
    ]
    paths = _runs_cdfs(runs, out)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["request_throughput"] for _, r in runs]
    for key, style in (
        ("p50_ttft_ms", "o-"),
        ("p99_ttft_ms", "s-"),
        ("p50_tpot_ms", "o--"),
        ("p99_tpot_ms", "s--"),
    ):
        y = [r.get(key) for _, r in runs]
        if any(v is not None for v in y):
            ax.plot(x, [np.nan if v is None else v for v in y], style, label=key.replace("_ms", ""))
    cfg = sweep["config"]
    for k in ("ttft", "tpot"):
        if cfg.get(f"slo_{k}_ms") is not None:
            ax.axhline(cfg[f"slo_{k}_ms"], linestyle=":", color="grey")
            ax.annotate(
                f"{k.upper()} SLO", (0, cfg[f"slo_{k}_ms"]), xycoords=("axes fraction", "data")
            )
    ax.set_xlabel("achieved request throughput (req/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"latency vs throughput (sweep over {param})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_throughput.png", dpi=100)
    plt.close(fig)
    return [*paths, out / "latency_throughput.png"]
