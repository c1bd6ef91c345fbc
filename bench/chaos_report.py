"""What `duet bench chaos` reports: availability (answered vs undefined, and with full tokens),
recovery time per kill, KV blocks still held after the load, usage against the client's own
counts, the batch job's exactly-once check, and per fault class the requests sent while one of
its faults was on — as rich tables and one JSON object (the PNG of availability and TTFT over
time with each fault's interval shaded is bench/plots.py's `plot_chaos`).

Invariant: every figure is computed from the records and the cluster's own answers after the
run; nothing is estimated.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import numpy as np

from bench.chaos_batch import BatchResult
from bench.chaos_faults import FaultEvent, timeline_rows
from bench.chaos_kill import Kill
from bench.chaos_load import Outcome, Record
from bench.chaos_usage import UsageCheck


def timeline(records: list[Record], duration: float, bin_s: float) -> list[dict[str, Any]]:
    """Per bin of send time: requests, full answers, answered (full or defined error), p99 TTFT."""
    out = []
    for b in range(int(np.ceil(duration / bin_s))):
        lo, hi = b * bin_s, (b + 1) * bin_s
        rs = [r for r in records if lo <= r.sent_s < hi and r.kind != "batch"]
        ttfts = [r.ttft_s for r in rs if r.ttft_s is not None and r.outcome == Outcome.FULL]
        out.append(
            {
                "t": lo,
                "requests": len(rs),
                "full": sum(r.outcome == Outcome.FULL for r in rs),
                "answered": sum(r.outcome != Outcome.UNDEFINED for r in rs),
                "p99_ttft_s": float(np.percentile(ttfts, 99)) if ttfts else None,
            }
        )
    return out


#: a kill's interval when its process never came back: this long after the kill
_KILL_UNTIL_S = 10.0


def fault_intervals(
    kills: list[Kill], events: list[FaultEvent], duration: float
) -> list[dict[str, Any]]:
    """Every fault as {kind, target, start_s, end_s}: a kill lasts until its process was back."""
    out = [
        {
            "kind": "kill",
            "target": k.name,
            "start_s": round(k.at_s, 1),
            "end_s": round(k.at_s + (k.back_s if k.back_s is not None else _KILL_UNTIL_S), 1),
            "detail": "SIGKILL",
            "pair": "",
        }
        for k in kills
    ]
    for row in timeline_rows(events):
        out.append({**row, "end_s": duration if row["end_s"] is None else row["end_s"]})
    return sorted(out, key=lambda r: r["start_s"])


def by_fault_class(records: list[Record], faults: list[dict[str, Any]]) -> dict[str, Any]:
    """Per class: faults injected, and the requests (stream + plain) whose life overlapped one
    of them — answered, full, defined errors and undefined by cause, p99 TTFT."""
    out: dict[str, Any] = {}
    rs = [r for r in records if r.kind != "batch"]
    for kind in sorted({f["kind"] for f in faults}):
        spans = [(f["start_s"], f["end_s"]) for f in faults if f["kind"] == kind]
        hit = [r for r in rs if any(r.sent_s < hi and r.end_s > lo for lo, hi in spans)]
        ttfts = [r.ttft_s for r in hit if r.ttft_s is not None and r.outcome == Outcome.FULL]
        causes: dict[str, int] = {}
        for r in hit:
            if r.outcome != Outcome.FULL:
                causes[f"{r.outcome}:{r.cause}"] = causes.get(f"{r.outcome}:{r.cause}", 0) + 1
        n = len(hit)
        out[kind] = {
            "faults": len(spans),
            "seconds": round(sum(hi - lo for lo, hi in spans), 1),
            "requests": n,
            "answered_pct": 100.0 * sum(r.outcome != Outcome.UNDEFINED for r in hit) / n
            if n
            else None,
            "full_pct": 100.0 * sum(r.outcome == Outcome.FULL for r in hit) / n if n else None,
            "causes": dict(sorted(causes.items(), key=lambda kv: -kv[1])),
            "p99_ttft_s": float(np.percentile(ttfts, 99)) if ttfts else None,
        }
    return out


def summarise(
    records: list[Record],
    kills: list[Kill],
    batch: BatchResult,
    kv_held: dict[str, int],
    usage: dict[str, Any],
    duration: float,
    bin_s: float,
    matched: UsageCheck | None = None,
    events: list[FaultEvent] | None = None,
) -> dict[str, Any]:
    n = len(records)
    full = sum(r.outcome == Outcome.FULL for r in records)
    defined = sum(r.outcome == Outcome.DEFINED_ERROR for r in records)
    undefined = [r for r in records if r.outcome == Outcome.UNDEFINED]
    causes: dict[str, int] = {}
    for r in records:
        if r.outcome != Outcome.FULL:
            causes[f"{r.outcome}:{r.cause}"] = causes.get(f"{r.outcome}:{r.cause}", 0) + 1
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None and r.outcome == Outcome.FULL]
    client = {
        "requests": sum(r.answered for r in records) + batch.lines * (batch.status == "completed"),
        "completion_tokens": sum(r.tokens for r in records if r.answered) + batch.completion_tokens,
    }
    faults = fault_intervals(kills, events or [], duration)
    return {
        "duration_s": duration,
        "faults": faults,
        "by_fault": by_fault_class(records, faults),
        "requests": n,
        "full": full,
        "defined_error": defined,
        "partial": sum(r.outcome == Outcome.PARTIAL for r in records),
        "undefined": len(undefined),
        "answered_pct": 100.0 * (n - len(undefined)) / n if n else None,
        "differs_from_reference": sum(r.differs_from_reference for r in records),
        "full_pct": 100.0 * full / n if n else None,
        "by_kind": {
            k: {
                "requests": sum(r.kind == k for r in records),
                "full": sum(r.kind == k and r.outcome == Outcome.FULL for r in records),
            }
            for k in sorted({r.kind for r in records})
        },
        "causes": dict(sorted(causes.items(), key=lambda kv: -kv[1])),
        # requests that did not get their full answer (the first 50, undefined ones first), with
        # the tokens each got
        "failures": [
            {
                "kind": r.kind,
                "sent_s": round(r.sent_s, 2),
                "end_s": round(r.end_s, 2),
                "outcome": str(r.outcome),
                "cause": r.cause,
                "tokens": r.tokens,
                "message": r.message,
            }
            for r in sorted(records, key=lambda r: r.outcome != Outcome.UNDEFINED)
            if r.outcome != Outcome.FULL
        ][:50],
        "differing_examples": [
            {"kind": r.kind, "sent_s": round(r.sent_s, 2), "message": r.message}
            for r in records
            if r.differs_from_reference
        ][:5],
        "p50_ttft_s": float(np.percentile(ttfts, 50)) if ttfts else None,
        "p99_ttft_s": float(np.percentile(ttfts, 99)) if ttfts else None,
        "kills": [
            {
                "name": k.name,
                "at_s": round(k.at_s, 1),
                "back_s": None if k.back_s is None else round(k.back_s, 1),
                "left_down": k.left_down,
            }
            for k in kills
        ],
        "max_recovery_s": max((k.back_s for k in kills if k.back_s is not None), default=None),
        "not_back": [k.name for k in kills if k.back_s is None],
        "kv_blocks_held_after": kv_held,
        # the totals (the gateway's include records of answers the client never got: they need
        # not be equal) and the per-request match, which must be exact
        "usage": {
            "gateway": usage,
            "client": client,
            "requests_match": matched.ok
            if matched is not None
            else usage.get("requests") == client["requests"],
            "completion_tokens_match": usage.get("completion_tokens")
            == client["completion_tokens"],
            "matched": msgspec.to_builtins(matched) if matched is not None else None,
        },
        "retried": sum(r.retried for r in records),
        "busy_retries": sum(r.busy_retries for r in records),
        "requests_busy_retried": sum(r.busy_retries > 0 for r in records),
        "batch": {
            **{f: getattr(batch, f) for f in batch.__struct_fields__},
            "exactly_once": batch.exactly_once,
        },
        "timeline": timeline(records, duration, bin_s),
    }


def _f(x: float | None, fmt: str = ".1f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{unit}"


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "0"


def render(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(
        width=None if sys.stdout.isatty() else 120
    )  # no terminal: do not squeeze the table
    t = Table(
        title=f"duet bench chaos: {s['duration_s']:.0f} s, {len(s['kills'])} kill(s)",
        show_header=False,
    )
    t.add_column("what")
    t.add_column("value")
    t.add_row("requests (stream + plain)", str(s["requests"]))
    t.add_row(
        "answered: tokens or a defined error",
        f"{s['requests'] - s['undefined']} ({_f(s['answered_pct'], '.2f', ' %')})",
    )
    t.add_row("  with their full tokens", f"{s['full']} ({_f(s['full_pct'], '.2f', ' %')})")
    t.add_row("  defined errors", str(s["defined_error"]))
    t.add_row("  streams cut after their first tokens (gateway died)", str(s.get("partial", 0)))
    t.add_row("undefined (connection error before any token, hang, no [DONE])", str(s["undefined"]))
    for cause, n in s["causes"].items():
        t.add_row(f"  {cause}", str(n))
    t.add_row(
        "full answers whose greedy text differs from the reference",
        str(s["differs_from_reference"]),
    )
    t.add_row(
        "TTFT p50 / p99 (streams, full answers)",
        f"{_f(s['p50_ttft_s'] and s['p50_ttft_s'] * 1e3, '.0f')} / "
        f"{_f(s['p99_ttft_s'] and s['p99_ttft_s'] * 1e3, '.0f')} ms",
    )
    for k in s["kills"]:
        back = (
            "left down (crash loop)"
            if k["left_down"]
            else ("NOT back" if k["back_s"] is None else f"back after {k['back_s']:.1f} s")
        )
        t.add_row(f"kill at {k['at_s']:.0f} s", f"{k['name']}: {back}")
    held = s["kv_blocks_held_after"]
    t.add_row(
        "KV blocks held after the load",
        ", ".join(f"{n}={b}" for n, b in held.items()) or "no node answered",
    )
    t.add_row("sent again (connection refused or reset, no answer)", str(s.get("retried", 0)))
    t.add_row(
        "sent again after a 429/503's Retry-After: requests / attempts",
        f"{s.get('requests_busy_retried', 0)} / {s.get('busy_retries', 0)}",
    )
    u = s["usage"]
    t.add_row(
        "usage records: gateway / client's answers",
        f"{u['gateway'].get('requests')} / {u['client']['requests']}",
    )
    if (m := u.get("matched")) is not None:
        if m["error"]:
            t.add_row("  matched per request", f"[red]{m['error']}[/]")
        else:
            t.add_row("  records by status", _counts(m["records"]))
            t.add_row(
                "  full answers billed once with their tokens",
                f"{m['exact']} / {m['full_answers']}"
                + ("" if m["exact"] == m["full_answers"] else f"  [red]{m['mismatched']}[/]"),
            )
            t.add_row(
                "  records of requests with no full answer",
                _counts(m["no_full_answer"])
                + (
                    f" ({m['no_full_answer_tokens']} completion tokens)"
                    if m["no_full_answer_tokens"]
                    else ""
                ),
            )
            t.add_row(
                "  requests billed twice",
                str(len(m["billed_twice"]))
                + (f"  [red]{m['billed_twice']}[/]" if m["billed_twice"] else ""),
            )
            if m["unknown"]:
                t.add_row("  records of requests never sent", f"[red]{m['unknown']}[/]")
    t.add_row(
        "usage completion tokens: gateway / client",
        f"{u['gateway'].get('completion_tokens')} / {u['client']['completion_tokens']}"
        + ("" if u["completion_tokens_match"] else "  [red]differ[/]"),
    )
    b = s["batch"]
    t.add_row(
        "batch",
        f"{b['status']}: {b['done_once']}/{b['lines']} lines exactly once, {b['succeeded']} ok, "
        f"{b['failed']} failed"
        + (f", duplicated {b['duplicated']}" if b["duplicated"] else "")
        + (f", missing {len(b['missing'])}" if b["missing"] else "")
        + (f" ({b['message']})" if b["message"] else ""),
    )
    con.print(t)


def render_faults(s: dict[str, Any]) -> None:
    """The chaos table per fault class."""
    from rich.console import Console
    from rich.table import Table

    if not s.get("by_fault"):
        return
    con = Console(width=None if sys.stdout.isatty() else 140)
    t = Table(title="per fault class: requests sent while one of its faults was on")
    for col in ("class", "faults", "s on", "requests", "answered", "full", "p99 TTFT", "not full"):
        t.add_column(col)
    for kind, c in s["by_fault"].items():
        t.add_row(
            kind,
            str(c["faults"]),
            f"{c['seconds']:.0f}",
            str(c["requests"]),
            _f(c["answered_pct"], ".1f", " %"),
            _f(c["full_pct"], ".1f", " %"),
            _f(c["p99_ttft_s"] and c["p99_ttft_s"] * 1e3, ".0f", " ms"),
            _counts(c["causes"]) if c["causes"] else "-",
        )
    con.print(t)
    f = Table(title="fault timeline")
    for col in ("start s", "end s", "class", "target", "detail"):
        f.add_column(col)
    for e in s["faults"]:
        f.add_row(f"{e['start_s']:.0f}", _f(e["end_s"], ".0f"), e["kind"], e["target"], e["detail"])
    con.print(f)
