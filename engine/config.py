"""EngineConfig: everything that sizes and shapes one engine instance, with sane defaults."""

from __future__ import annotations

import re
from dataclasses import dataclass

from protocol.block_hash import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_SEED
from runtime.models import DEFAULT_MODEL


def parse_size(text: str | int) -> int:
    """'512MiB', '2GB', '1g', 1048576 → bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not m:
        raise ValueError(f"cannot read size {text!r} (try 512MiB or 2GiB)")
    mult = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2)]
    return int(float(m.group(1)) * mult)


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    #: "auto": bf16 on CUDA, and on CPUs with native bf16 GEMM (avx512_bf16/AMX), else fp32
    dtype: str = "auto"
    #: "auto": cuda when available, else cpu
    device: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    #: KV pool size as a block count; if None, derived from kv_memory
    num_kv_blocks: int | None = None
    kv_memory: str | int = "1GiB"
    #: None: the model's max_position_embeddings
    max_model_len: int | None = None
    max_num_seqs: int = 128
    #: tokens computed per step (the chunked-prefill budget)
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    hash_seed: int = DEFAULT_HASH_SEED
    seed: int = 0
    #: torch intra-op threads on CPU; None leaves torch's default
    threads: int | None = None
    #: backpressure: requests queued (not yet admitted) before new ones are refused as overload
    max_waiting_requests: int = 256
    #: backpressure: prompt tokens queued before new requests are refused as overload
    max_waiting_tokens: int = 262144
    #: quantization of the linear layers: None (the model dtype); weight-only "int8" (per-channel
    #: scales), "int4" (groups of 32) or "int4-g64" (activations and the KV cache keep `dtype`); or
    #: W8A8 "int8-w8a8" / "int4-w4a8" (activations quantized per token to int8, int8 GEMMs)
    quantization: str | None = None
    #: speculative decoding: None (off), "ngram" (prompt lookup: drafts copied from the prompt and
    #: the output so far) or a draft model: "draft-int4" (self-speculation: the target's weights at
    #: int4), "draft-int4-w4a8", "draft-int8", "draft" (engine/spec_decode.py); greedy output
    #: unchanged, sampled output distributed as without it
    speculative: str | None = None
    #: draft-model speculation ("draft" methods): a separate draft model of the target's tokenizer
    #: (None: self-speculation, the target's own weights at the method's quantization)
    speculative_model: str | None = None
    #: the draft model's own KV pool in blocks (None: room for spec_max_batch full-length sequences,
    #: at most the target's pool)
    spec_draft_kv_blocks: int | None = None
    #: most draft tokens per request and step (each request adapts its own k below this); None:
    #: the method's default (engine/spec_decode.py NUM_SPECULATIVE_TOKENS: 5 for ngram, 8 for the
    #: draft-model methods, whose self-draft is accepted 94-100 % of the time here)
    num_speculative_tokens: int | None = None
    #: no drafts while more requests than this run or wait (larger batches are compute-bound);
    #: None: the method's default (engine/spec_decode.py SPEC_MAX_BATCH: 4 for ngram, 1 for the
    #: draft-model methods, whose drafting and verifying cost more than they give at 2 or more here)
    spec_max_batch: int | None = None
    #: colocated nodes: size each step's prefill chunk so the predicted step (an online fit of
    #: step times, engine/step_model.py) stays within this inter-token latency; None: the fixed
    #: max_num_batched_tokens budget alone
    itl_target_ms: float | None = None
    #: keep BlockStored/BlockRemoved events for the coordinator
    record_kv_events: bool = False
