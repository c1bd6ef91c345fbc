"""Writes the load traces of tests/planner (kept in git; rerun only to change them):
`python tests/planner/traces/make.py`. Figures are pool totals (planner/trace.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
P = "prefill/smollm2-135m/interactive"
PB = "prefill/smollm2-135m/batch"
D = "decode/smollm2-135m/interactive"
COLD = {"queued_prefill_tokens": 50000, "waiting": 40, "kv": 0.95}
#: a decode node warming up: a full KV pool, a long admission queue and many sequences
D_COLD = {"running": 200, "waiting": 40, "kv": 0.95}


def write(name: str, head: dict, rows: list[dict]) -> None:
    lines = [json.dumps(head)] + [json.dumps(r) for r in rows]
    (HERE / name).write_text("\n".join(lines) + "\n")


def main() -> None:
    # one P, then the queue rises 6× for 3 minutes
    write(
        "scale_out.jsonl",
        {"interval_s": 5, "pools": {P: {"replicas": 1}}, "cold": COLD, "cold_s": 60},
        [
            {"t": t, "pools": {P: {"queued_prefill_tokens": 500 if t < 60 else 3000, "kv": 0.1}}}
            for t in range(0, 240, 5)
        ],
    )
    # three P with a steady queue that two carry with margin, and one would not
    write(
        "scale_in.jsonl",
        {"interval_s": 5, "pools": {P: {"replicas": 3}}, "cold": COLD},
        [
            {"t": t, "pools": {P: {"queued_prefill_tokens": 1800, "kv": 0.3}}}
            for t in range(0, 600, 5)
        ],
    )
    # an interactive and a batch pool both overloaded; the budget has room for one more node
    write(
        "budget.jsonl",
        {"interval_s": 5, "pools": {P: {"replicas": 1}, PB: {"replicas": 1}}, "cold": COLD},
        [
            {
                "t": t,
                "pools": {
                    P: {"queued_prefill_tokens": 4000, "kv": 0.2},
                    PB: {"queued_prefill_tokens": 200000, "kv": 0.2},
                },
            }
            for t in range(0, 300, 5)
        ],
    )
    # 10 minutes with noise (×0.4 to ×1.8) on every sample: 2 minutes at the base, 3 minutes at 4×,
    # back
    rng = random.Random(27)
    rows = []
    for t in range(0, 600, 5):
        base = 3600 if 120 <= t < 300 else 900
        rows.append(
            {
                "t": t,
                "pools": {
                    P: {"queued_prefill_tokens": round(base * rng.uniform(0.4, 1.8)), "kv": 0.1}
                },
            }
        )
    write("noisy_step.jsonl", {"interval_s": 5, "pools": {P: {"replicas": 1}}, "cold": COLD}, rows)

    # decode pools (default step: ITL = 0.05 + 0.00256 × sequences per node; SLO 0.15 s):
    # one D whose running sequences triple at 60 s (ITL 0.10 → 0.20 s at one node, 0.13 at two)
    write(
        "decode_itl.jsonl",
        {"interval_s": 5, "pools": {D: {"replicas": 1}}, "cold": D_COLD, "cold_s": 60},
        [
            {"t": t, "pools": {D: {"running": 20 if t < 60 else 60, "kv": 0.2}}}
            for t in range(0, 240, 5)
        ],
    )
    # one D whose admission queue fills at 60 s (2 waiting: over 1 per node at one, not at two)
    write(
        "decode_queue.jsonl",
        {"interval_s": 5, "pools": {D: {"replicas": 1}}, "cold": D_COLD, "cold_s": 60},
        [
            {"t": t, "pools": {D: {"running": 10, "waiting": 0 if t < 60 else 2, "kv": 0.3}}}
            for t in range(0, 240, 5)
        ],
    )
    # one D whose KV use climbs past 70 % at 60 s (1.2 node-capacities: 60 % each at two)
    write(
        "decode_kv.jsonl",
        {"interval_s": 5, "pools": {D: {"replicas": 1}}, "cold": D_COLD, "cold_s": 60},
        [
            {"t": t, "pools": {D: {"running": 5, "kv": 0.4 if t < 60 else 1.2}}}
            for t in range(0, 240, 5)
        ],
    )
    # three D with 40 sequences: two carry them with margin (ITL 0.101 ≤ 0.7 × 0.15), one would not
    write(
        "decode_scale_in.jsonl",
        {"interval_s": 5, "pools": {D: {"replicas": 3}}, "cold": D_COLD},
        [{"t": t, "pools": {D: {"running": 40, "kv": 0.6}}} for t in range(0, 600, 5)],
    )
    # throughput mode: 0.3 req/s of 256 prompt / 32 output tokens for 2 minutes, then 3 req/s
    write(
        "throughput_step.jsonl",
        {"interval_s": 5, "pools": {P: {"replicas": 1}, D: {"replicas": 1}}, "cold": COLD},
        [
            {
                "t": t,
                "pools": {P: {}, D: {}},
                "rates": {
                    "smollm2-135m/interactive": {
                        "rate": 0.3 if t <= 120 else 3.0,
                        "isl": 256,
                        "osl": 32,
                        "prefix_hit": 0.0,
                    }
                },
            }
            for t in range(0, 240, 5)
        ],
    )


if __name__ == "__main__":
    main()
