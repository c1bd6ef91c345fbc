"""Model FLOP accounting, GEMM peak measurement and a description of the machine.

Model FLOPs count what a step must compute: 2 x every weight a token touches (all layer
GEMMs; the LM head only for tokens whose logits are sampled) plus attention, 4 x heads x
head_dim per (query, visible key) pair (q.k and p.v). Peaks are the best of a few large square
GEMMs at the benchmark's thread count, so "fraction of peak" compares like with like: the
engine's figure is divided by `linear_peak_gflops`, a GEMM through the engine's own `Linear`
(oneDNN-prepacked weights for bf16 on the CPU, F.linear otherwise) in the dtype the engine
runs; plain `torch.mm` peaks (`gemm_peak_gflops`) are reported beside it for reference.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, cfg) -> ModelShape:  # engine.model_config.ModelConfig
        return cls(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.vocab_size,
        )

    @property
    def layer_params(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        return qkv + o + 3 * self.hidden * self.intermediate

    def flops(self, new_tokens: int, sampled: int, attended_pairs: int) -> float:
        """FLOPs of a step: `new_tokens` through every layer, `sampled` through the LM head,
        `attended_pairs` (query, key) pairs summed over the step's tokens, per layer."""
        gemm = 2 * (
            self.layers * self.layer_params * new_tokens + self.hidden * self.vocab * sampled
        )
        attn = 4 * self.layers * self.heads * self.head_dim * attended_pairs
        return float(gemm + attn)

    def prefill_flops(self, prompt_len: int) -> float:
        return self.flops(prompt_len, 1, prompt_len * (prompt_len + 1) // 2)

    def decode_flops(self, batch: int, ctx_from: int, steps: int) -> float:
        """`steps` decode steps of `batch` sequences whose context starts at `ctx_from`."""
        pairs = batch * sum(ctx_from + s + 1 for s in range(steps))
        return self.flops(batch * steps, batch * steps, pairs)


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm: first-call setup (oneDNN primitive creation) is not throughput
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_peak_gflops(dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """Plain torch.mm of two n x n matrices."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    with torch.inference_mode():
        return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def linear_peak_gflops(dtype: torch.dtype, n: int, repeats: int = 5) -> tuple[float, str]:
    """An n x n weight through the engine's `Linear` (prepacked when the engine would prepack it)
    applied to n rows; returns (GFLOP/s, the path taken: "linear_bf16" (the project's AMX GEMM),
    "onednn_prepacked" or "F.linear")."""
    from engine.linear import Linear

    weight = torch.randn(n, n).to(dtype)
    x = torch.randn(n, n).to(dtype)
    lin = Linear(weight)  # built as the engine builds its layers; called as its forward does
    path = (
        "linear_bf16"
        if lin.panels is not None
        else "onednn_prepacked"
        if lin.packed is not None
        else "F.linear"
    )
    with torch.inference_mode():
        return 2 * n**3 / _best_seconds(lambda: lin(x), repeats) / 1e9, path


def read_bandwidth_gbps(mib: int = 512, repeats: int = 5) -> float:
    """Streaming read bandwidth from memory at torch's thread count: the best of a few sums over
    an fp32 buffer far larger than any cache (a vectorised sum does ~1 add per 4 bytes, so the
    memory, not the adds, bounds it). Single-stream decode of a small model reads every weight
    once per token, so this over the bytes a step reads is that workload's tokens/s ceiling."""
    buf = torch.ones(mib * 2**18, dtype=torch.float32)
    with torch.inference_mode():
        return buf.nbytes / _best_seconds(lambda: buf.sum(), repeats) / 1e9


def machine_info(threads: int) -> dict[str, object]:
    from engine.cpu import cpu_flags, cpu_model

    flags = cpu_flags()
    cpu = cpu_model() or platform.processor() or platform.machine()
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "isa": sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags),
        "torch": torch.__version__,
        "transformers": tf_version,
        "python": platform.python_version(),
        "load_avg_1m_at_start": round(load[0], 2),
    }
