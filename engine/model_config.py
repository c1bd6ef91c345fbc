"""The model hyper-parameters the engine needs, read from a HF `config.json`.

Every architecture shares these fields (engine/models/ registers which model types the engine
runs and how each one reads its own extras into `arch`). The Llama family (Llama 2/3, Mistral,
Qwen2, Qwen3, SmolLM2): RMSNorm, rotary embeddings (default, linear, llama3 scaling), SwiGLU MLP,
grouped-query attention, optional q/k/v bias (Qwen2), per-head q/k RMSNorm before the rotary
embedding (Qwen3, whose Qwen3-Embedding models duet serves with `--task embed`) and tied
embeddings. A model type the engine does not run is refused here, with the reason, before any
weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class UnsupportedModel(ValueError):
    """A checkpoint the native engine cannot run exactly (refused at load, never served wrong)."""


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
    #: one window for every layer (Mistral); per-layer windows live in `arch` (Gemma)
    sliding_window: int | None
    torch_dtype: str
    #: Qwen3: RMSNorm over each head of q and k (weights [head_dim]) before the rotary embedding
    qk_norm: bool = False
    #: the architecture's own settings (engine/models/: a frozen dataclass of its module), None
    #: for the Llama family
    arch: Any = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        from engine.models import architecture  # the registry imports this module

        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return architecture(cfg.get("model_type", "llama")).parse(cfg)

    @property
    def kv_attention(self) -> str:
        """KVLayout.attention: "" for the Llama family; else the model type, and the layers'
        kinds where the architecture says them (`arch.layer_kinds`, with `arch.window`)."""
        if self.model_type in LLAMA_FAMILY:
            return ""
        kinds = getattr(self.arch, "layer_kinds", None)
        if not kinds or (len(set(kinds)) == 1 and self.arch.window is None):
            return self.model_type
        layers = "".join(k[0] for k in kinds)
        return f"{self.model_type};window={self.arch.window};layers={layers}"

    @classmethod
    def base(cls, cfg: dict[str, Any], **overrides: Any) -> ModelConfig:
        """The shared fields as a Llama-family config.json spells them (`overrides` win)."""
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        theta, scaling = rope_settings(cfg)
        window = (
            cfg.get("sliding_window")
            if cfg.get("use_sliding_window", model_type == "mistral")
            else None
        )
        fields: dict[str, Any] = dict(
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
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=window,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype") or "float32",
            qk_norm=model_type == "qwen3",
        )
        fields.update(overrides)
        return cls(**fields)


#: the model types LlamaModel runs as they are (no `arch`)
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})
#: rope scalings engine/rope.py computes exactly as transformers does
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_settings(
    cfg: dict[str, Any], params: dict[str, Any] | None = None
) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from a config.json: transformers 5 folds rope settings into
    `rope_parameters` (`params`: one layer type's entry of it), 4.x has rope_theta/rope_scaling."""
    rope = params if params is not None else cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = (None if params is not None else cfg.get("rope_scaling")) or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ROPE_TYPES:
            raise UnsupportedModel(
                f"unsupported rope scaling {scaling}; the native engine computes {ROPE_TYPES}"
            )
        if kind == "default":
            scaling = None
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedModel("a partial rotary embedding (partial_rotary_factor < 1)")
    return float(theta), scaling
