"""Load Llama-family weights from safetensors into the engine's fused layout.

q/k/v projections are concatenated into one matrix (one GEMM instead of three), as are gate
and up; everything is cast once to the engine dtype on the engine device. Tied embeddings
share one tensor.

With `quantization`, the fused linear matrices and the lm_head become QuantizedWeights
(engine/quant.py), quantized from the full-precision source (never from a bf16 copy), or read
from the cache `duet models pull --quantize` wrote (engine/quant_store.py); norms and the
embedding stay in the engine dtype.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model_config import ModelConfig
from engine.quant import (
    LM_HEAD_SCHEME,
    WEIGHT_FORMAT,
    QuantizedWeight,
    check_scheme,
    quantize,
)
from engine.quant_smooth import SCHEMES as SMOOTHED_SCHEMES
from engine.quant_store import load_quantized

Matrix = torch.Tensor | QuantizedWeight
log = logging.getLogger("duet.engine.weights")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Matrix
    qkv_bias: torch.Tensor | None
    o: Matrix
    post_norm: torch.Tensor
    gate_up: Matrix
    down: Matrix
    #: Qwen3's per-head q/k norms ([head_dim]); None for the rest of the family
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Matrix


def load_weights(
    model_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    use_cache: bool = True,
) -> ModelWeights:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(str(f)))
    if quantization in ("none", ""):
        quantization = None
    cached: dict[str, QuantizedWeight] = {}
    t0 = time.monotonic()
    smooth = quantization in SMOOTHED_SCHEMES
    if quantization is not None:
        # int8-w8a8 quantizes its weight format's matrices after smoothing them
        # (engine/quant_smooth.py), so the weight-only cache does not hold them
        quantization = WEIGHT_FORMAT[check_scheme(quantization)]
        cached = (
            load_quantized(model_dir, quantization) if use_cache and not smooth else None
        ) or {}

    def take(name: str) -> torch.Tensor:
        try:
            return raw.pop(name)
        except KeyError:
            raise KeyError(f"{model_dir}: weight {name!r} missing") from None

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def matrix(name: str, parts: list[str], scheme: str | None = quantization) -> Matrix:
        """A linear weight: the cached quantized copy, else the source parts fused (and quantized)."""
        if scheme is None:
            return put(torch.cat([take(p) for p in parts]) if len(parts) > 1 else take(parts[0]))
        if name in cached:
            for p in parts:
                raw.pop(p, None)
            return cached[name].to(device)
        w = torch.cat([take(p) for p in parts])
        if scheme.startswith("int4") and w.shape[1] % 64:
            log.warning(
                "%s: in_features %d is not a multiple of 64; int8 instead of %s",
                name,
                w.shape[1],
                scheme,
            )
            scheme = "int8"
        return quantize(w, scheme).to(device)

    # A base-model checkpoint (Qwen3-Embedding saved as Qwen3Model) names its weights without
    # the causal LM's "model." prefix, and has no lm_head (tied to the embedding below).
    root = (
        "" if "model.embed_tokens.weight" not in raw and "embed_tokens.weight" in raw else "model."
    )
    if smooth:
        from engine.quant_smooth import smooth_checkpoint

        smooth_checkpoint(raw, Path(model_dir), cfg, root)
    layers = []
    for i in range(cfg.num_layers):
        p = f"{root}layers.{i}."
        bias = None
        if cfg.attention_bias:
            bias = put(torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
        layers.append(
            LayerWeights(
                input_norm=put(take(p + "input_layernorm.weight")),
                qkv=matrix(p + "qkv", [p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
                qkv_bias=bias,
                o=matrix(p + "o", [p + "self_attn.o_proj.weight"]),
                post_norm=put(take(p + "post_attention_layernorm.weight")),
                gate_up=matrix(
                    p + "gate_up", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
                ),
                down=matrix(p + "down", [p + "mlp.down_proj.weight"]),
                q_norm=put(take(p + "self_attn.q_norm.weight")) if cfg.qk_norm else None,
                k_norm=put(take(p + "self_attn.k_norm.weight")) if cfg.qk_norm else None,
            )
        )
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in raw
    embed_src = take(f"{root}embed_tokens.weight")
    embed = put(embed_src)
    lm_head: Matrix
    if quantization is None:
        lm_head = embed if tied else put(take("lm_head.weight"))
    else:
        if tied:
            raw["lm_head.weight"] = embed_src
        lm_head = matrix("lm_head", ["lm_head.weight"], LM_HEAD_SCHEME[quantization])
        mats = [lm_head, *(m for lw in layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down))]
        log.info(
            "weights quantized to %s: %.1f MiB of linear weights, %s in %.1f s",
            quantization,
            sum(m.nbytes for m in mats if isinstance(m, QuantizedWeight)) / 2**20,
            "read from the cache" if cached else "quantized at load",
            time.monotonic() - t0,
        )
    return ModelWeights(
        embed=embed, layers=layers, norm=put(take(f"{root}norm.weight")), lm_head=lm_head
    )
