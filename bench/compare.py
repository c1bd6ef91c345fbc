"""`duet bench compare A.json B.json`: two `duet bench serve --json` results side by side, with
B/A ratios, so "did this change help" is one command. For sweeps, the runs are matched by
their sweep value and the knees compared.

Invariant: reads only the two files; a metric missing or null on either side shows as "-".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

#: (key, label, better): better is "higher" or "lower", for the verdict column
METRICS: tuple[tuple[str, str, str], ...] = (
    ("completed", "completed", "higher"),
    ("failed", "failed", "lower"),
    ("request_throughput", "request throughput (req/s)", "higher"),
    ("request_goodput", "goodput (req/s)", "higher"),
    ("output_throughput", "output throughput (tok/s)", "higher"),
    ("total_token_throughput", "total throughput (tok/s)", "higher"),
    ("achieved_request_rate", "achieved send rate (req/s)", "higher"),
    *(
        (f"{stat}_{m}_ms", f"{stat} {m.upper()} (ms)", "lower")
        for m in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "p99")
    ),
)


def load(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict) or not ("completed" in data or "runs" in data):
        raise ValueError(f"{path} is not a `duet bench serve --json` result")
    return data


def rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, label, better in METRICS:
        va, vb = a.get(key), b.get(key)
        if not isinstance(va, (int, float)) or not isinstance(vb, (int, float)):
            if va is None and vb is None:
                continue
            out.append(
                {"metric": key, "label": label, "a": va, "b": vb, "ratio": None, "better": None}
            )
            continue
        ratio = vb / va if va else None
        verdict = None
        if va != vb:
            verdict = "b" if (vb > va) == (better == "higher") else "a"
        out.append(
            {"metric": key, "label": label, "a": va, "b": vb, "ratio": ratio, "better": verdict}
        )
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    if ("runs" in a) != ("runs" in b):
        raise ValueError("cannot compare a sweep with a single run: compare two runs or two sweeps")
    if "runs" not in a:
        return {"rows": rows(a, b)}
    va = [str(v) for v in a["sweep"]["values"]]
    vb = [str(v) for v in b["sweep"]["values"]]
    runs = {v: rows(a["runs"][va.index(v)], b["runs"][vb.index(v)]) for v in va if v in vb}
    return {
        "param": a["sweep"]["param"],
        "knee": {"a": a["knee"]["value"], "b": b["knee"]["value"]},
        "runs": runs,
    }


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:,.2f}" if isinstance(x, float) else str(x)


def _table(title: str, rs: list[dict[str, Any]], name_a: str, name_b: str) -> Table:
    t = Table(title=title, title_justify="left")
    for c in ("metric", name_a, name_b, "B/A", "better"):
        t.add_column(c, justify="left" if c == "metric" else "right")
    for r in rs:
        better = {"a": name_a, "b": name_b}.get(r["better"] or "", "")
        t.add_row(
            r["label"],
            _fmt(r["a"]),
            _fmt(r["b"]),
            "-" if r["ratio"] is None else f"{r['ratio']:.3f}x",
            better,
        )
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="duet bench compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("a", help="baseline result (A)")
    p.add_argument("b", help="result to compare with it (B)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument(
        "--plot",
        metavar="DIR",
        help="also draw both runs in DIR: latency CDFs and TTFT over the run (two runs only)",
    )
    args = p.parse_args(argv)
    try:
        a, b = load(args.a), load(args.b)
        result = compare(a, b)
    except ValueError as e:
        print(f"duet bench compare: error: {e}", file=sys.stderr)
        return 2
    name_a = a.get("label") or Path(args.a).stem
    name_b = b.get("label") or Path(args.b).stem
    if name_a == name_b:
        name_a, name_b = f"A: {name_a}", f"B: {name_b}"
    if args.plot and "rows" in result:
        from bench.plots import plot_runs

        for path in plot_runs([(name_a, a), (name_b, b)], Path(args.plot)):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps({"a": args.a, "b": args.b, **result}))
        return 0
    console = Console() if sys.stdout.isatty() else Console(width=120)
    if "rows" in result:
        console.print(_table(f"{name_a} vs {name_b}", result["rows"], name_a, name_b))
    else:
        for value, rs in result["runs"].items():
            console.print(_table(f"{result['param']}={value}", rs, name_a, name_b))
        console.print(
            f"knee ({result['param']}): {name_a} {_fmt(result['knee']['a'])}, "
            f"{name_b} {_fmt(result['knee']['b'])}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
