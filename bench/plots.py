"""PNG plots of a run or a sweep (matplotlib, Agg: no display needed).

Run: `ttft_cdf.png`, `itl_cdf.png` (empirical CDFs, ms), `throughput.png` (output tokens/s
and completions/s per second of the run) and `ttft_over_time.png` (each request's TTFT at its
send time, and a rolling median of 25). Sweep: the same for every run overlaid, plus
`latency_throughput.png` (p50/p99 TTFT and TPOT against achieved request throughput, SLO
lines when given). Returns the paths written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _plt() -> Any:  # matplotlib.pyplot, imported only when a plot is drawn
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
    paths.append(_ttft_over_time(runs, out))
    return paths


def _ttft_over_time(runs: list[tuple[str, dict[str, Any]]], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, r) in enumerate(runs):
        pts = sorted(
            (t, v * 1e3) for t, v in zip(r["start_times"], r["ttfts"], strict=True) if v is not None
        )
        if not pts:
            continue
        x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        color = f"C{i}"
        ax.scatter(x, y, s=6, alpha=0.3, color=color)
        k = min(25, len(y))
        med = [float(np.median(y[max(0, j - k + 1) : j + 1])) for j in range(len(y))]
        ax.plot(x, med, color=color, label=f"{label} (rolling median)".strip())
    ax.set_xlabel("send time since start (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("TTFT over the run")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_over_time.png", dpi=100)
    plt.close(fig)
    return out / "ttft_over_time.png"


def plot_runs(runs: list[tuple[str, dict[str, Any]]], out: Path) -> list[Path]:
    """Several labelled runs on the same axes (`duet bench compare --plot`)."""
    out.mkdir(parents=True, exist_ok=True)
    return _runs_cdfs(runs, out)


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


#: one colour per fault class, shading its intervals in the chaos plot
_FAULT_COLOURS = {
    "kill": "tab:red",
    "stop": "tab:purple",
    "partition": "tab:orange",
    "delay": "tab:olive",
    "loss": "tab:cyan",
    "etcd": "tab:brown",
    "disk": "tab:pink",
}


def plot_chaos(s: dict[str, Any], path: Path) -> Path:
    """`duet bench chaos`'s summary: availability (answered, full tokens) and p99 TTFT per time
    bin, each fault's interval shaded in its class's colour (one legend entry per class)."""
    plt = _plt()
    tl = s["timeline"]
    x = [p["t"] for p in tl]
    avail = [100.0 * p["full"] / p["requests"] if p["requests"] else np.nan for p in tl]
    answered = [100.0 * p["answered"] / p["requests"] if p["requests"] else np.nan for p in tl]
    p99 = [p["p99_ttft_s"] * 1e3 if p["p99_ttft_s"] is not None else np.nan for p in tl]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    a1.step(x, answered, where="post", label="answered (tokens or a defined error)", color="k")
    a1.step(x, avail, where="post", label="full tokens", color="tab:blue")
    a1.set_ylabel("% of requests sent")
    a1.set_ylim(-5, 105)
    a2.step(x, p99, where="post", color="tab:green")
    a2.set_ylabel("p99 TTFT (ms)")
    a2.set_xlabel("time since start (s)")
    seen: set[str] = set()
    faults = s.get("faults") or [
        {"kind": "kill", "start_s": k["at_s"], "end_s": k["at_s"] + (k["back_s"] or 1.0)}
        for k in s.get("kills", [])
    ]
    for f in faults:
        colour = _FAULT_COLOURS.get(f["kind"], "tab:gray")
        end = f["end_s"] if f["end_s"] is not None else s["duration_s"]
        for ax in (a1, a2):
            ax.axvspan(
                f["start_s"],
                max(end, f["start_s"] + 0.5),
                color=colour,
                alpha=0.18,
                lw=0,
                label=f["kind"] if ax is a1 and f["kind"] not in seen else None,
            )
        seen.add(f["kind"])
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    a1.legend(loc="lower left", fontsize=8, ncol=4)
    width = x[1] - x[0] if len(x) > 1 else s["duration_s"]
    a1.set_title(f"chaos: availability and p99 TTFT per {width:.0f} s (shaded: faults)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
