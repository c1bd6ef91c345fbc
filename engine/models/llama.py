"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) in the registry: LlamaModel
(engine/model.py) over load_weights' fused layers."""

from __future__ import annotations

from typing import Any

from engine.model import LlamaModel
from engine.model_config import LLAMA_FAMILY, ModelConfig
from engine.models import Architecture, BuildSpec
from engine.quant import ACT_GROUPS, ACT_INT8
from engine.rope import Rope
from engine.weights import LLAMA_GATE_UP, LLAMA_QKV, load_weights


def parse(cfg: dict[str, Any]) -> ModelConfig:
    return ModelConfig.base(cfg)


def build_llama(
    spec: BuildSpec,
    qkv_parts: tuple[str, ...] = LLAMA_QKV,
    gate_up_parts: tuple[str, ...] = LLAMA_GATE_UP,
) -> LlamaModel:
    cfg, q = spec.cfg, spec.quantization
    weights = load_weights(
        spec.model_dir,
        cfg,
        spec.dtype,
        spec.device,
        q,
        qkv_parts=qkv_parts,
        gate_up_parts=gate_up_parts,
    )
    rope = Rope(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, spec.max_model_len, spec.dtype, spec.device
    )
    return LlamaModel(
        cfg,
        weights,
        rope,
        spec.device,
        act_int8=q in ACT_INT8,
        act_groups=ACT_GROUPS.get(q or ""),
    )


_LLAMA = Architecture("the Llama family", parse, build_llama)
ARCHITECTURES = dict.fromkeys(LLAMA_FAMILY, _LLAMA)
