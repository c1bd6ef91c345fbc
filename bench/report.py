"""The result of a run (one JSON object: vLLM-compatible metric keys at the top level, the full
config, breakdowns by team and tier, a throughput timeline, scrapes, per-request arrays) and
its human form (rich tables on stdout).

Invariant: the JSON is built from the records and config only, so the tables, plots and
`duet bench compare` all read the same numbers.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import metrics_calc
from bench.loadgen import RunOutcome
from bench.serve_config import ServeConfig


def build_result(
    cfg: ServeConfig, outcome: RunOutcome, scrapes: dict[str, Any] | None = None
) -> dict[str, Any]:
    recs = outcome.records
    slo = {"slo_ttft_ms": cfg.slo_ttft_ms, "slo_tpot_ms": cfg.slo_tpot_ms}
    result: dict[str, Any] = {
        "date": datetime.datetime.fromtimestamp(outcome.started_at, datetime.UTC).isoformat(),
        "label": cfg.label,
        "backend": "openai-chat" if cfg.chat else "openai",
        "base_url": cfg.base_url,
        "endpoint": cfg.endpoint,
        "model_id": cfg.model,
        "tokenizer_id": cfg.tokenizer,
        "num_prompts": len(recs),
        "request_rate": "inf" if cfg.request_rate == float("inf") else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "config": cfg.public(),
        "warmup": {"sent": outcome.warmup_sent, "failed": outcome.warmup_failed},
        "interrupted": outcome.interrupted,
    }
    result.update(
        metrics_calc.compute(
            recs,
            outcome.duration_s,
            configured_rate=cfg.request_rate,
            percentiles=cfg.percentiles,
            **slo,
        )
    )
    result["by_team"] = metrics_calc.breakdown(recs, "team", cfg.percentiles, **slo)
    result["by_tier"] = metrics_calc.breakdown(recs, "tier", cfg.percentiles, **slo)
    result["by_turn"] = metrics_calc.breakdown(recs, "turn", cfg.percentiles, **slo)
    bucket = metrics_calc.bucket_for(outcome.duration_s)
    result["throughput_timeline_bucket_s"] = bucket
    result["throughput_timeline"] = metrics_calc.timeline(recs, bucket)
    result["scrapes"] = scrapes or {}
    result.update(metrics_calc.per_request(recs))
    return result


def _f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def console() -> Console:
    """stdout; wide enough for the tables when it is a file or a pipe (rich assumes 80)."""
    return Console() if sys.stdout.isatty() else Console(width=120)


def print_run(r: dict[str, Any], console: Console) -> None:
    cfg = r["config"]
    title = f"duet bench serve: {r['base_url']}{r['endpoint']}" + (
        f" [{r['label']}]" if r.get("label") else ""
    )
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    fails = ", ".join(f"{k} {v}" for k, v in r["failures"].items())
    t.add_row(
        "requests sent",
        str(r["num_requests"]) + ("  (stopped early by Ctrl-C)" if r.get("interrupted") else ""),
    )
    t.add_row(
        "completed / failed",
        f"{r['completed']} / {r['failed']}" + (f"  ({fails})" if fails else ""),
    )
    if r["warmup"]["sent"]:
        t.add_row(
            "warm-up (excluded)", f"{r['warmup']['sent']} sent, {r['warmup']['failed']} failed"
        )
    t.add_row("duration (s)", _f(r["duration"]))
    t.add_row(
        "request rate: configured / achieved",
        f"{r['configured_request_rate']} / {_f(r['achieved_request_rate'])}",
    )
    t.add_row("request throughput (req/s)", _f(r["request_throughput"]))
    if r["request_goodput"] is not None:
        slo = ", ".join(
            f"{k} ≤ {cfg[f'slo_{k}_ms']:g} ms"
            for k in ("ttft", "tpot")
            if cfg[f"slo_{k}_ms"] is not None
        )
        t.add_row(
            f"goodput (req/s; {slo})", f"{_f(r['request_goodput'])}  ({r['good_requests']} good)"
        )
    t.add_row("output throughput (tok/s)", _f(r["output_throughput"]))
    t.add_row("total token throughput (tok/s)", _f(r["total_token_throughput"]))
    t.add_row("input / output tokens", f"{r['total_input_tokens']} / {r['total_output_tokens']}")
    if r["total_cached_tokens"]:
        t.add_row("cached prompt tokens (usage)", str(r["total_cached_tokens"]))
    t.add_row(
        "send lag mean / max (ms)", f"{_f(r['mean_send_lag_ms'])} / {_f(r['max_send_lag_ms'])}"
    )
    mt = r.get("multi_turn")
    if mt:
        t.add_row(
            "multi-turn: conversations × turns, users",
            f"{mt['conversations']} × {mt['turns']}, {mt['users']}",
        )
        t.add_row("multi-turn: working set (tokens)", f"{mt['working_set_tokens']:,}")
        for turn, row in r.get("by_turn", {}).items():
            t.add_row(f"  turn {turn}: TTFT median (ms)", _f(row.get("median_ttft_ms")))
    console.print(t)
    pcts = [f"p{p:g}" for p in cfg["percentiles"]]
    lt = Table(title="latency (ms)", title_justify="left")
    for c in ("metric", "mean", *pcts, "std"):
        lt.add_column(c, justify="left" if c == "metric" else "right")
    for name in metrics_calc.LATENCIES:
        lt.add_row(
            name.upper(),
            _f(r[f"mean_{name}_ms"]),
            *(_f(r[f"{p}_{name}_ms"]) for p in pcts),
            _f(r[f"std_{name}_ms"]),
        )
    console.print(lt)
    for key in ("by_team", "by_tier"):
        if r.get(key):
            _print_breakdown(key.replace("by_", ""), r[key], pcts[-1], console)
    for url, s in (r.get("scrapes") or {}).items():
        summary = s["summary"]
        st = Table(title=f"server metrics: {url}", show_header=False, title_justify="left")
        st.add_column("metric")
        st.add_column("value", justify="right")
        for k, v in summary.items():
            st.add_row(k, _f(v, 3))
        console.print(st)


def _print_breakdown(what: str, rows: dict[str, dict[str, Any]], p: str, console: Console) -> None:
    t = Table(title=f"by {what}", title_justify="left")
    good = any("good_requests" in row for row in rows.values())
    for c in (
        what,
        "completed",
        "failed",
        "mean TTFT",
        f"{p} TTFT",
        "mean TPOT",
        f"{p} TPOT",
        *(["good"] if good else []),
    ):
        t.add_column(c, justify="left" if c == what else "right")
    for name, row in rows.items():
        t.add_row(
            name,
            str(row["completed"]),
            str(row["failed"]),
            _f(row["mean_ttft_ms"]),
            _f(row[f"{p}_ttft_ms"]),
            _f(row["mean_tpot_ms"]),
            _f(row[f"{p}_tpot_ms"]),
            *([str(row.get("good_requests", "-"))] if good else []),
        )
    console.print(t)


def print_sweep(s: dict[str, Any], console: Console) -> None:
    param = s["sweep"]["param"]
    t = Table(title=f"sweep over {param}", title_justify="left")
    for c in (
        param,
        "completed",
        "failed",
        "req/s",
        "out tok/s",
        "p99 TTFT ms",
        "p99 TPOT ms",
        "goodput",
        "meets SLO",
    ):
        t.add_column(c, justify="right")
    for value, run, meets in zip(s["sweep"]["values"], s["runs"], s["meets_slo"], strict=True):
        t.add_row(
            _f(value, 3),
            str(run["completed"]),
            str(run["failed"]),
            _f(run["request_throughput"]),
            _f(run["output_throughput"]),
            _f(run.get("p99_ttft_ms")),
            _f(run.get("p99_tpot_ms")),
            _f(run["request_goodput"]),
            "-" if meets is None else ("yes" if meets else "no"),
        )
    console.print(t)
    knee = s["knee"]
    if knee["value"] is not None:
        console.print(
            f"knee: {param} = {_f(knee['value'], 3)} (highest whose p99 TTFT ≤ "
            f"{knee['slo_ttft_ms']:g} ms)"
        )
    else:
        console.print(f"knee: none ({knee['reason']})")
