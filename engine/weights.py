"""Load Llama-family weights from safetensors into the engine's fused layout.

q/k/v projections are concatenated into one matrix (one GEMM instead of three), as are gate
and up; everything is cast once to the engine dtype on the engine device. Tied embeddings
share one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model_config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(str(f)))

    def take(name: str) -> torch.Tensor:
        try:
            return raw.pop(name)
        except KeyError:
            raise KeyError(f"{model_dir}: weight {name!r} missing") from None

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        bias = None
        if cfg.attention_bias:
            bias = put(torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
        layers.append(
            LayerWeights(
                input_norm=put(take(p + "input_layernorm.weight")),
                qkv=put(qkv),
                qkv_bias=bias,
                o=put(take(p + "self_attn.o_proj.weight")),
                post_norm=put(take(p + "post_attention_layernorm.weight")),
                gate_up=put(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                down=put(take(p + "mlp.down_proj.weight")),
            )
        )
    embed = put(take("model.embed_tokens.weight"))
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in raw else put(take("lm_head.weight"))
    return ModelWeights(embed=embed, layers=layers, norm=put(take("model.norm.weight")), lm_head=lm_head)
