"""`python -m bench.sleep_engine`: sleep mode's figures for one model, in one run: what a sleep
releases (weights, KV pool pages) and how long it takes, and the time to wake — the weights
rebuilt by the first request after the sleep — against that request's latency on an awake engine.

`--repeats` rounds (3): a request on the awake engine (its latency is the baseline), sleep, the
same request again (it wakes the engine: its latency is the wake plus the request). The KV pool
is `--kv-memory` (1GiB, the node's default). Medians are reported; progress on stderr, a table or
JSON (--json) on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench.flops import machine_info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.sleep_engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from engine import LLM, SamplingParams
    from engine.sleep import resident_bytes

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_memory=args.kv_memory,
        threads=args.threads,
    )
    load_s = time.perf_counter() - t0
    core = llm.engine
    prompt = list(range(100, 164))
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prompt], params)  # warm-up
    rounds: list[dict[str, float]] = []
    for i in range(args.repeats):
        t = time.perf_counter()
        llm.generate([prompt], params)
        awake_s = time.perf_counter() - t
        report = core.sleep()
        pool = core.runner.kv_cache
        t = time.perf_counter()
        llm.generate([prompt], params)
        woken_s = time.perf_counter() - t
        rounds.append(
            {
                "awake_request_s": awake_s,
                "sleep_s": report.seconds,
                "weights_mib": report.weight_bytes / 2**20,
                "kv_released_mib": report.kv_bytes_released / 2**20,
                "wake_s": core.last_wake_s or 0.0,
                "woken_request_s": woken_s,
                "pool_resident_mib": resident_bytes(pool) / 2**20,
            }
        )
        print(f"round {i + 1}: {rounds[-1]}", file=sys.stderr)
    med = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
    summary = {
        "model": args.model,
        "dtype": core.runner.kv_layout.dtype,
        "quantization": args.quantization,
        "kv_memory": args.kv_memory,
        "cold_load_s": round(load_s, 2),
        **med,
        "machine": machine_info(torch.get_num_threads()),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"{args.model} ({summary['dtype']}): sleep {med['sleep_s']:.2f} s releases "
            f"{med['weights_mib']:.0f} MiB of weights and {med['kv_released_mib']:.0f} MiB of KV "
            f"pool; wake {med['wake_s']:.2f} s (first request after it "
            f"{med['woken_request_s']:.2f} s against {med['awake_request_s']:.2f} s awake; a cold "
            f"load took {load_s:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
