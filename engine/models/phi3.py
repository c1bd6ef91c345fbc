"""Phi-3 (Phi-3 / Phi-3.5 mini and medium): the Llama forward over checkpoints whose q/k/v and
gate/up projections are already fused (`qkv_proj`, `gate_up_proj`, split as transformers splits
them: q rows, then k, then v; gate rows, then up), with LongRoPE scaling (engine/rope.py) for the
128k-context variants and a sliding window over every layer where the config sets one.

int8-w8a8 is refused: its smoothing (engine/quant_smooth.py) folds scales into q/k/v and gate/up
by their Llama names.
"""

from __future__ import annotations

from typing import Any

from engine.model_config import ModelConfig, UnsupportedModel
from engine.models import Architecture, BuildSpec
from engine.models.llama import build_llama


def parse(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"Phi-3 with hidden_act {cfg['hidden_act']!r} (silu only)")
    c = ModelConfig.base(cfg, sliding_window=cfg.get("sliding_window"), attention_bias=False)
    scaling = c.rope_scaling
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
        # transformers reads these from the top level when rope_parameters lacks them
        original = scaling.get(
            "original_max_position_embeddings", cfg.get("original_max_position_embeddings")
        )
        if original is None:
            raise UnsupportedModel("longrope without original_max_position_embeddings")
        factor = scaling.get("factor") or c.max_position_embeddings / original
        scaling = {
            **scaling,
            "rope_type": "longrope",
            "original_max_position_embeddings": original,
            "factor": factor,
        }
        c = ModelConfig.base(
            cfg,
            sliding_window=cfg.get("sliding_window"),
            attention_bias=False,
            rope_scaling=scaling,
        )
    return c


def build(spec: BuildSpec) -> Any:
    return build_llama(spec, ("self_attn.qkv_proj.weight",), ("mlp.gate_up_proj.weight",))


ARCHITECTURES = {
    "phi3": Architecture(
        "Phi-3",
        parse,
        build,
        (("int8-w8a8", "its smoothing names q/k/v and gate/up as the Llama family does"),),
    )
}
