"""A small hand-written profile for simulator tests (a CPU-node-like step model)."""

from __future__ import annotations

from sim.profile import NodeKind, Overheads, Profile, Provenance, StepModel, Transport


def toy_profile(kv_tokens: int = 16 * 2000, max_num_seqs: int = 64) -> Profile:
    return Profile(
        kind=NodeKind(name="toy", model="m", dtype="bf16", device="cpu", kv_bytes_per_token=1000,
                      kv_capacity_tokens=kv_tokens, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                      max_model_len=4096),
        step=StepModel(intercept_s=0.01, prefill_s=1e-4, decode_s=5e-4, context_s=1e-6, attention_s=1e-9,
                       provenance=Provenance.MODELLED),
        transport=Transport(backend="tcp", bandwidth_bytes_per_s=1e9, latency_s=1e-3, provenance=Provenance.MODELLED),
        overheads=Overheads(request_s=2e-3, pd_hop_s=2e-3, stream_s=5e-4),
    )  # fmt: skip
