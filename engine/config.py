"""EngineConfig: everything that sizes and shapes one engine instance, with sane defaults."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

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


#: quantization of the linear layers (engine/quant.py)
Quantization = Literal["int8", "int4", "int4-g64", "int8-w8a8", "int4-w4a8"]
#: how the KV pool stores K and V (engine/kv_quant.py); fp8 is vLLM's (--engine vllm)
KVCacheDtype = Literal["auto", "int8", "fp8"]
#: speculative decoding methods (engine/spec_decode.py)
Speculative = Literal["ngram", "draft-int4", "draft-int4-w4a8", "draft-int8", "draft"]


@dataclass
class EngineConfig:
    """Everything that sizes and shapes one engine; `duet node`'s engine flags are generated from
    these fields (duet/config_flags.py), their help from the `#:` comments."""

    #: registry name, .gguf file or HF directory
    model: str = DEFAULT_MODEL
    #: auto, bfloat16 or float32; auto: bf16 on CUDA, on CPUs with bf16 arithmetic (AVX-512
    #: BF16/AMX), and on AVX2 + FMA CPUs for bf16 checkpoints (the kernels stream the weights in
    #: bf16 and widen them in registers: faster than fp32), else fp32; the node logs its choice
    dtype: str = "auto"
    #: auto, cpu or cuda[:N]; auto: cuda when available, else cpu
    device: str = "auto"
    #: tokens per KV block
    block_size: int = DEFAULT_BLOCK_SIZE
    #: KV pool size in blocks (overrides --kv-memory)
    num_kv_blocks: int | None = field(default=None, metadata={"flag": "kv-blocks"})
    #: KV pool size in bytes, e.g. 512MiB
    kv_memory: str | int = "1GiB"
    #: how the KV pool stores K and V: auto keeps the model's dtype (--dtype); int8 stores 8-bit
    #: values with a per-token, per-KV-head fp32 scale, so --kv-memory holds ~2x the tokens of
    #: bf16 (~4x of fp32) at a small accuracy cost (docs/benchmarks.md "8-bit KV"). Prefill and
    #: decode nodes must agree (the KV layout hash refuses a mismatch). The CPU kernels store and
    #: read int8 rows (prefill chunks attend on SDPA). fp8 is for --engine vllm only (vLLM's
    #: kv_cache_dtype)
    kv_cache_dtype: KVCacheDtype = "auto"
    #: context limit (default: the model's max_position_embeddings)
    max_model_len: int | None = None
    #: sequences running at once
    max_num_seqs: int = 128
    #: tokens computed per step (the chunked-prefill budget)
    max_num_batched_tokens: int = 512
    #: a prompt longer than the step's budget is prefilled in chunks across steps (off: whole)
    enable_chunked_prefill: bool = True
    #: reuse the KV of prompts' common prefixes across requests
    enable_prefix_caching: bool = True
    #: seed of the prefix cache's block hashes: every process of a cluster must use the same one
    #: (protocol/block_hash.py)
    hash_seed: int = DEFAULT_HASH_SEED
    #: seed of the sampler's random numbers
    seed: int = 0
    #: torch intra-op threads on CPU (default: torch's)
    threads: int | None = None
    #: backpressure: queued requests beyond which new ones get 503 + Retry-After
    max_waiting_requests: int = 256
    #: backpressure: queued prompt tokens beyond which new requests get 503 + Retry-After
    max_waiting_tokens: int = 262144
    #: quantization of the linear layers (native engine): int8, int4 and int4-g64 are weight-only
    #: (int8 per-channel scales, int4 groups of 32 or 64; activations and the KV cache keep
    #: --dtype); int8-w8a8 and int4-w4a8 also quantize activations per token to int8 for int8
    #: GEMMs (faster prefill and batches). Quantize once ahead with `duet models pull
    #: --quantize`
    quantization: Quantization | None = None
    #: speculative decoding (native engine): ngram drafts tokens by prompt lookup (pays on
    #: summaries, edits, RAG answers); draft-int4 (-int4-w4a8, -int8) drafts with the model's own
    #: weights at int4 (a second, cheaper copy) and verifies with the full model; draft uses
    #: --speculative-model as it is. Greedy output is unchanged, sampled output keeps its
    #: distribution; off by itself above --spec-max-batch requests running or waiting
    speculative: Speculative | None = None
    #: a separate draft model (name or directory) for the draft methods; it must share the
    #: model's tokenizer (default: the model itself, self-speculation)
    speculative_model: str | None = field(default=None, metadata={"metavar": "MODEL"})
    #: the draft model's own KV pool in blocks (default: room for --spec-max-batch full-length
    #: sequences, at most the target's pool)
    spec_draft_kv_blocks: int | None = None
    #: most draft tokens a request proposes per step; each request adapts its own k below this
    #: to its acceptance. Default: 5 for ngram, 8 for the draft methods (their int4 self-draft is
    #: accepted 94-100 % of the time: docs/benchmarks.md)
    num_speculative_tokens: int | None = field(default=None, metadata={"metavar": "K"})
    #: draft only while at most N requests run or wait (0: never). Default: 4 for ngram, 1 for
    #: the draft methods: on a CPU a batch already shares each weight read, and there a draft
    #: model's drafting and verifying cost more than they give from 2 requests on
    #: (docs/benchmarks.md)
    spec_max_batch: int | None = None
    #: native engine, colocated nodes: size each step's prefill chunk from an online model of
    #: step time (prefill tokens, decode batch, context: engine/step_model.py) so decode steps
    #: stay within MS; --max-num-batched-tokens stays the cap, and every step still takes at
    #: least 32 prompt tokens, so long prompts progress (default: off, the fixed budget alone)
    itl_target_ms: float | None = None
    #: keep BlockStored/BlockRemoved events for the coordinator
    record_kv_events: bool = False
    #: LoRA adapters resident at once (0: LoRA off, the linears unwrapped); loading one more
    #: unloads the least recently used adapter no queued or running request names
    max_loras: int = 0
    #: the highest LoRA rank an adapter slot holds (vLLM's max_lora_rank)
    max_lora_rank: int = 16
    #: native engine: a host-memory tier under the KV pool, in bytes (or a size like 4GiB):
    #: cached blocks the pool evicts are copied there and loaded back, checked, when a prompt
    #: reuses them (0: off)
    kv_host_bytes: str | int = field(default=0, metadata={"metavar": "SIZE"})
    #: native engine: a disk tier under the host tier, in bytes (or a size like 20GiB): blocks
    #: the host tier evicts (the pool's, without one) go to files in --kv-disk-dir (0: off)
    kv_disk_bytes: str | int = field(default=0, metadata={"metavar": "SIZE"})
    #: the disk tier's directory, the node's alone: its *.kv files are removed at start (default:
    #: $DUET_HOME/kv-spill/NODE_ID)
    kv_disk_dir: str | None = field(default=None, metadata={"metavar": "DIR"})
