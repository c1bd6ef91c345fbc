"""Writes the load traces of tests/planner (kept in git; rerun only to change them):
`python tests/planner/traces/make.py`. Figures are pool totals (planner/trace.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
P = "prefill/smollm2-135m/interactive"
PB = "prefill/smollm2-135m/batch"
COLD = {"queued_prefill_tokens": 50000, "waiting": 40, "kv": 0.95}


def write(name: str, head: dict, rows: list[dict]) -> None:
    lines = [json.dumps(head)] + [json.dumps(r) for r in rows]
    (HERE / name).write_text("\n".join(lines) + "\n")


def main() -> None:
    # one P, then the queue rises 6× for 3 minutes
    write("scale_out.jsonl", {"interval_s": 5, "pools": {P: {"replicas": 1}}, "cold": COLD, "cold_s": 60},
          [{"t": t, "pools": {P: {"queued_prefill_tokens": 500 if t < 60 else 3000, "kv": 0.1}}}
           for t in range(0, 240, 5)])
    # three P with a steady queue that two carry with margin, and one would not
    write("scale_in.jsonl", {"interval_s": 5, "pools": {P: {"replicas": 3}}, "cold": COLD},
          [{"t": t, "pools": {P: {"queued_prefill_tokens": 1800, "kv": 0.3}}} for t in range(0, 600, 5)])
    # an interactive and a batch pool both overloaded; the budget has room for one more node
    write("budget.jsonl", {"interval_s": 5, "pools": {P: {"replicas": 1}, PB: {"replicas": 1}}, "cold": COLD},
          [{"t": t, "pools": {P: {"queued_prefill_tokens": 4000, "kv": 0.2},
                              PB: {"queued_prefill_tokens": 200000, "kv": 0.2}}} for t in range(0, 300, 5)])
    # 10 minutes with noise (×0.4 to ×1.8) on every sample: 2 minutes at the base, 3 minutes at 4×, back
    rng = random.Random(27)
    rows = []
    for t in range(0, 600, 5):
        base = 3600 if 120 <= t < 300 else 900
        rows.append({"t": t, "pools": {P: {"queued_prefill_tokens": round(base * rng.uniform(0.4, 1.8)), "kv": 0.1}}})
    write("noisy_step.jsonl", {"interval_s": 5, "pools": {P: {"replicas": 1}}, "cold": COLD}, rows)


if __name__ == "__main__":
    main()
