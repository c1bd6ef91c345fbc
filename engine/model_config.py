"""The model hyper-parameters the engine needs, read from a HF `config.json`.

Supports the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2): RMSNorm, rotary
embeddings (default, linear, dynamic-free llama3 scaling), SwiGLU MLP, grouped-query attention,
optional q/k/v bias (Qwen2), per-head q/k RMSNorm before the rotary embedding (Qwen3, whose
Qwen3-Embedding models duet serves with `--task embed`) and tied embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    torch_dtype: str
    #: Qwen3: RMSNorm over each head of q and k (weights [head_dim]) before the rotary embedding
    qk_norm: bool = False

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED:
            raise ValueError(
                f"unsupported model type {model_type!r}; the native engine runs {sorted(SUPPORTED)}"
            )
        heads = cfg["num_attention_heads"]
        # transformers 5 folds rope settings into rope_parameters; 4.x has rope_theta/rope_scaling.
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in (
            "default",
            "linear",
            "llama3",
        ):
            raise ValueError(f"unsupported rope scaling {scaling}")
        window = (
            cfg.get("sliding_window")
            if cfg.get("use_sliding_window", model_type == "mistral")
            else None
        )
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=window,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype") or "float32",
            qk_norm=model_type == "qwen3",
        )
