"""The architectures the native engine runs, by Hugging Face `model_type`: a small registry.

Each entry says how a `config.json` becomes a ModelConfig (`parse`, which refuses what the
architecture's code does not compute exactly) and how a model directory becomes the model the
runner calls (`build`: `forward(ids, kv_cache, md, rows)` → fp32 logits, `hidden_states` for
embeddings). The Llama family (engine/model.py, the kernel-tuned path) and Phi-3 (engine/models/
phi3.py: the same forward over checkpoints with fused qkv/gate_up) share LlamaModel; Gemma 1/2/3
(engine/models/gemma.py) and the mixture-of-experts families (engine/models/moe.py) run on
engine/models/decoder.py's DecoderModel.

Invariant: a model type outside the registry, or a setting an entry does not compute exactly
(a partial rotary embedding, bidirectional attention, W8A8 smoothing outside the Llama family),
is refused with `UnsupportedModel` naming the reason, before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model_config import ModelConfig, UnsupportedModel

__all__ = ["Architecture", "BuildSpec", "UnsupportedModel", "architecture", "build_model"]


@dataclass(frozen=True)
class BuildSpec:
    """Everything an architecture's `build` reads."""

    model_dir: Path
    cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    quantization: str | None = None


@dataclass(frozen=True)
class Architecture:
    #: the family's name in messages and docs
    name: str
    parse: Callable[[dict[str, Any]], ModelConfig]
    build: Callable[[BuildSpec], Any]
    #: quantization schemes it cannot take, each with the reason
    refused_quantization: tuple[tuple[str, str], ...] = ()


#: model types seen in the wild that the engine refuses, with the reason (the rest get a list)
_REFUSED = {
    "gemma3": "a Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration): the native "
    "engine runs Gemma 3's text models (model_type gemma3_text, e.g. gemma-3-1b)",
    "qwen2_moe": "Qwen2-MoE's shared expert and its sigmoid gate are not implemented",
    "deepseek_v2": "multi-head latent attention is not implemented",
    "deepseek_v3": "multi-head latent attention is not implemented",
    "phimoe": "PhiMoE's sparsemixer routing is not implemented",
}


def _registry() -> dict[str, Architecture]:
    from engine.models import gemma, llama, moe, phi3

    return {**llama.ARCHITECTURES, **phi3.ARCHITECTURES, **gemma.ARCHITECTURES, **moe.ARCHITECTURES}


def architecture(model_type: str) -> Architecture:
    table = _registry()
    if model_type in table:
        return table[model_type]
    why = _REFUSED.get(model_type, "no implementation of its forward pass")
    raise UnsupportedModel(
        f"unsupported model type {model_type!r} ({why}); the native engine runs "
        f"{sorted(table)} — the vLLM engine (`--engine vllm`) takes many more"
    )


def build_model(spec: BuildSpec) -> Any:
    """The model for `spec`, or UnsupportedModel when its quantization does not apply."""
    arch = architecture(spec.cfg.model_type)
    for scheme, why in arch.refused_quantization:
        if spec.quantization == scheme:
            raise UnsupportedModel(f"{arch.name} cannot take {scheme} quantization: {why}")
    return arch.build(spec)
