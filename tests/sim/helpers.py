"""Test helpers for the simulator: a small hand-written profile (a CPU-node-like step model), and
a hand-written `duet bench serve` result in sim.validate's layout (a measured case to replay)."""

from __future__ import annotations

import json
from pathlib import Path

from sim.profile import NodeKind, Overheads, Profile, Provenance, StepModel, Transport


def toy_profile(kv_tokens: int = 16 * 2000, max_num_seqs: int = 64) -> Profile:
    return Profile(
        kind=NodeKind(
            name="toy",
            model="m",
            dtype="bf16",
            device="cpu",
            kv_bytes_per_token=1000,
            kv_capacity_tokens=kv_tokens,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=512,
            max_model_len=4096,
        ),
        step=StepModel(
            intercept_s=0.01,
            prefill_s=1e-4,
            decode_s=5e-4,
            context_s=1e-6,
            attention_s=1e-9,
            provenance=Provenance.MODELLED,
        ),
        transport=Transport(
            backend="tcp", bandwidth_bytes_per_s=1e9, latency_s=1e-3, provenance=Provenance.MODELLED
        ),
        overheads=Overheads(request_s=2e-3, pd_hop_s=2e-3, stream_s=5e-4),
    )


def write_serve_result(
    case: Path,
    n: int,
    *,
    gap_s: float,
    input_len: int,
    output_len: int,
    ttft_s: float,
    e2el_s: float,
    p50_tpot_ms: float,
    output_throughput: float,
) -> None:
    """`case`/serve.json: n equal requests `gap_s` apart, every one with the same measured
    figures."""
    case.mkdir(parents=True, exist_ok=True)
    (case / "serve.json").write_text(
        json.dumps(
            {
                "config": {"output_len": str(output_len), "prefix_groups": 0, "prefix_len": 0},
                "num_requests": n,
                "completed": n,
                "failed": 0,
                "scheduled_times": [gap_s * i for i in range(n)],
                "input_lens": [input_len] * n,
                "output_lens": [output_len] * n,
                "ttfts": [ttft_s] * n,
                "e2els": [e2el_s] * n,
                "cached_tokens": [0] * n,
                "groups": [None] * n,
                "p50_ttft_ms": ttft_s * 1e3,
                "p90_ttft_ms": ttft_s * 1e3,
                "p50_tpot_ms": p50_tpot_ms,
                "output_throughput": output_throughput,
            }
        )
    )
