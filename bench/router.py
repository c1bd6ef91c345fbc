"""`python -m bench.router`: how well `model: "auto"` routes, on the held-out test split.

Reads data/router_eval (the fixed train/test split), classifies every test prompt with the
shipped weights (fit on the train split only by `python -m gateway.backends.providers.auto.fit`),
and reports accuracy, per-class precision/recall, the confusion matrix, how often a prompt went to
a model weaker than its label asks for (under-routed: a quality risk) or stronger (over-routed:
wasted money), the classifier's latency (per prompt, the median of 5 runs), and the cost of the test
set routed by `auto` against always using the strongest model and against a perfect router (the true
labels).

Costs need token counts the evaluation set does not have: prompt tokens are estimated from the
text (~4 characters a token) and completion tokens are assumed per class
(`--completion-tokens`). The default catalog's prices are examples; pass `--catalog` with your
own (a JSON list of gateway.backends.providers.catalog.ModelEntry objects). Progress goes to stderr;
stdout gets a table, or one JSON object with --json.

This module imports the gateway's classifier (torch-free) on purpose: it measures that code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from gateway.backends.providers.auto.chooser import RANK_FOR, AutoPolicy, choose
from gateway.backends.providers.auto.classifier import LABELS, WEIGHTS, Classifier
from gateway.backends.providers.auto.dataset import DATA_DIR, digest, load
from gateway.backends.providers.auto.features import features
from gateway.backends.providers.catalog import ModelEntry
from gateway.backends.providers.cost import estimate_tokens

DEFAULT_CATALOG = [
    ModelEntry(
        name="smollm2",
        capability_rank=1,
        context_length=8192,
        input_price_per_m=0.05,
        output_price_per_m=0.05,
    ),
    ModelEntry(
        name="gpt-4o-mini",
        capability_rank=2,
        context_length=128000,
        input_price_per_m=0.15,
        output_price_per_m=0.60,
        paid=True,
    ),
    ModelEntry(
        name="claude-sonnet",
        capability_rank=3,
        context_length=200000,
        input_price_per_m=3.00,
        output_price_per_m=15.00,
        paid=True,
    ),
]
DEFAULT_COMPLETION = "simple=60,medium=300,hard=900"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--data",
        type=Path,
        default=DATA_DIR,
        help="evaluation set directory (default: %(default)s)",
    )
    p.add_argument(
        "--weights", type=Path, default=WEIGHTS, help="classifier weights (default: %(default)s)"
    )
    p.add_argument(
        "--split",
        choices=("test", "train"),
        default="test",
        help="split to evaluate (default: test; train only as a sanity check)",
    )
    p.add_argument(
        "--catalog",
        type=Path,
        help="JSON list of ModelEntry objects (default: an example 3-model catalog)",
    )
    p.add_argument(
        "--completion-tokens",
        default=DEFAULT_COMPLETION,
        help="assumed completion tokens per class, for costs (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args(argv)


def _completion(spec: str) -> dict[str, int]:
    out = {}
    for part in spec.split(","):
        k, _, v = part.partition("=")
        if k.strip() not in LABELS or not v.strip().isdigit():
            raise SystemExit(
                f"--completion-tokens: expected label=int for each of {LABELS}, got {part!r}"
            )
        out[k.strip()] = int(v)
    if set(out) != set(LABELS):
        raise SystemExit(f"--completion-tokens must give all of {LABELS}")
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    clf = Classifier.load(a.weights)
    rows = [r for r in load(a.data) if r["split"] == a.split]
    catalog_list = (
        msgspec.json.decode(a.catalog.read_bytes(), type=list[ModelEntry])
        if a.catalog
        else DEFAULT_CATALOG
    )
    catalog = {m.name: m for m in catalog_list}
    strongest = max(catalog_list, key=lambda m: (m.capability_rank, -m.output_price_per_m))
    completion = _completion(a.completion_tokens)
    by_rank = {
        lbl: min(
            (m for m in catalog_list if m.capability_rank >= RANK_FOR[lbl]),
            key=lambda m: m.expected_cost(1000, completion[lbl]),
            default=strongest,
        )
        for lbl in LABELS
    }
    print(f"router eval: {len(rows)} {a.split} prompts, {len(catalog)} models", file=sys.stderr)

    confusion = {t: dict.fromkeys(LABELS, 0) for t in LABELS}
    cost = {"auto": 0.0, "strongest": 0.0, "oracle": 0.0}
    routed: dict[str, int] = dict.fromkeys(catalog, 0)
    under = over = 0
    latencies = []
    for r in rows:  # warm-up: first calls pay for imports and caches, not per-request work
        clf.predict_features(features(r["messages"]))
    for r in rows:
        # the median of 5 timed runs per prompt: one run alone mostly measures the machine's
        # other tenants (a descheduled thread costs milliseconds), not this code
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            pred = clf.predict_features(features(r["messages"]))
            runs.append((time.perf_counter() - t0) * 1e6)
        latencies.append(statistics.median(runs))
        confusion[r["label"]][pred.label] += 1
        prompt = sum(
            estimate_tokens(m["content"] if isinstance(m["content"], str) else "")
            for m in r["messages"]
        )
        out = completion[r["label"]]  # what the request really needs, whoever answers it
        choice = choose(
            pred,
            catalog,
            tier="interactive",
            policy=AutoPolicy(),
            prompt_tokens=prompt,
            max_tokens=None,
        )
        assert choice.model is not None
        routed[choice.model] += 1
        got_rank = catalog[choice.model].capability_rank
        under += got_rank < RANK_FOR[r["label"]]
        over += got_rank > RANK_FOR[r["label"]]
        cost["auto"] += catalog[choice.model].expected_cost(prompt, out)
        cost["strongest"] += strongest.expected_cost(prompt, out)
        cost["oracle"] += by_rank[r["label"]].expected_cost(prompt, out)

    n = len(rows)
    correct = sum(confusion[t][t] for t in LABELS)
    per_class = {}
    for lbl in LABELS:
        tp = confusion[lbl][lbl]
        predicted = sum(confusion[t][lbl] for t in LABELS)
        actual = sum(confusion[lbl].values())
        per_class[lbl] = {
            "precision": round(tp / predicted, 4) if predicted else None,
            "recall": round(tp / actual, 4) if actual else None,
            "support": actual,
        }
    lat = sorted(latencies)
    return {
        "split": a.split,
        "prompts": n,
        "accuracy": round(correct / n, 4),
        "per_class": per_class,
        "confusion": confusion,  # confusion[true][predicted]
        "under_routed": round(under / n, 4),
        "over_routed": round(over / n, 4),
        "routed_to": routed,
        "cost_usd": {k: round(v, 6) for k, v in cost.items()},
        "cost_ratio_auto_vs_strongest": round(cost["auto"] / cost["strongest"], 4)
        if cost["strongest"]
        else None,
        "cost_ratio_oracle_vs_strongest": round(cost["oracle"] / cost["strongest"], 4)
        if cost["strongest"]
        else None,
        "strongest_model": strongest.name,
        "classifier_latency_us": {
            "p50": round(statistics.median(lat), 1),
            "p99": round(lat[min(n - 1, int(n * 0.99))], 1),
            "max": round(lat[-1], 1),
        },
        "assumptions": {
            "completion_tokens": completion,
            "prompt_tokens": "chars / 4",
            "catalog": [msgspec.to_builtins(m) for m in catalog_list],
        },
        "weights": {
            "fit": clf.weights.fit,
            "fresh": clf.weights.fit.get("data_sha256") == digest(a.data),
        },
    }


def _table(r: dict[str, Any]) -> str:
    lines = [
        f"auto router on the {r['split']} split: {r['prompts']} prompts, accuracy "
        f"{r['accuracy']:.1%}"
        + ("" if r["weights"]["fresh"] else "  (weights fit on other data: re-run the fit)")
    ]
    lines.append("confusion (rows: true label, columns: predicted)")
    lines.append(f"  {'':8}" + "".join(f"{lbl:>8}" for lbl in LABELS) + f"{'recall':>9}")
    for t in LABELS:
        rec = r["per_class"][t]["recall"]
        lines.append(
            f"  {t:8}"
            + "".join(f"{r['confusion'][t][p]:>8}" for p in LABELS)
            + f"{rec if rec is not None else '-':>9}"
        )
    lines.append(
        f"under-routed {r['under_routed']:.1%}   over-routed {r['over_routed']:.1%}   routed to "
        f"{r['routed_to']}"
    )
    c = r["cost_usd"]
    lines.append(
        f"cost of the split: auto ${c['auto']:.4f}   always {r['strongest_model']} "
        f"${c['strongest']:.4f}   perfect router ${c['oracle']:.4f}   (auto/strongest "
        f"{r['cost_ratio_auto_vs_strongest']})"
    )
    lat = r["classifier_latency_us"]
    lines.append(
        f"classifier latency (features + prediction): p50 {lat['p50']} us, p99 {lat['p99']} us"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    r = run(a)
    print(json.dumps(r, indent=1) if a.json else _table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
