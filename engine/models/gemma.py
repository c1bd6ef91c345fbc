"""Gemma 1, 2 and 3 (text models) on DecoderModel (engine/models/decoder.py).

What sets them apart from Llama, all as transformers computes them:
- RMSNorm weights are offsets: the norm multiplies by (1 + w), in fp32; the loader stores 1 + w
  (in fp32) so every norm is a plain RMSNorm;
- embeddings are scaled by √hidden_size (the factor rounded to the weights' dtype);
- the MLP's activation is tanh-approximated GeLU (`gelu_pytorch_tanh`, or what the config names);
- Gemma 2/3: sandwich norms (post-attention, pre- and post-feed-forward), attention layers that
  alternate between a sliding window and the full context (`layer_types`; Gemma 2 every other
  layer, Gemma 3 five sliding to one full), queries scaled by query_pre_attn_scalar^-½;
- Gemma 2: attention scores and final logits soft-capped (tanh(x / cap) · cap);
- Gemma 3: per-head q/k RMSNorm before the rotary embedding, and a rotary table per layer kind
  (sliding layers: the local base frequency; full layers: rope_theta with its scaling).

Refused: bidirectional attention (Gemma 3 embedding variants set `use_bidirectional_attention`),
W8A8 smoothing (Llama names only). Every quantization else applies: linears through make_linear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.logits_head import LogitsHead
from engine.model_config import ModelConfig, UnsupportedModel, rope_settings
from engine.models import Architecture, BuildSpec
from engine.models.decoder import FULL, SLIDING, DecoderLayer, DecoderModel, DecoderSpec, GatedMLP
from engine.qlinear import make_linear
from engine.quant import ACT_INT8
from engine.rope import Rope
from engine.weights import Checkpoint

#: config activations → DecoderModel's names
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "silu": "silu"}


@dataclass(frozen=True)
class GemmaArch:
    version: int
    layer_kinds: tuple[str, ...]
    window: int | None
    query_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    act: str
    #: Gemma 3's sliding layers: their own (theta, scaling)
    local_rope: tuple[float, dict[str, Any] | None] | None = None


def _kinds(cfg: dict[str, Any], version: int) -> tuple[str, ...]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = {1: 0, 2: 2, 3: cfg.get("sliding_window_pattern", 6)}[version]
        types = [
            "sliding_attention" if every and (i + 1) % every else "full_attention" for i in range(n)
        ]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModel(f"Gemma layer_types {types!r}")
    return tuple(SLIDING if t == "sliding_attention" else FULL for t in types)


def parse(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg["model_type"]
    version = {"gemma": 1, "gemma2": 2, "gemma3_text": 3}[model_type]
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel("Gemma with bidirectional attention (an embedding variant)")
    act_name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act_name not in ACTIVATIONS:
        raise UnsupportedModel(f"Gemma with hidden activation {act_name!r}")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kinds = _kinds(cfg, version)
    rope = cfg.get("rope_parameters") or {}
    overrides: dict[str, Any] = {
        "sliding_window": None,
        "attention_bias": bool(cfg.get("attention_bias", False)),
    }
    local = None
    if version == 3:
        if "full_attention" in rope:  # transformers 5: one entry per layer kind
            overrides["rope_theta"], overrides["rope_scaling"] = rope_settings(
                cfg, rope["full_attention"]
            )
            local = rope_settings(cfg, rope.get("sliding_attention") or {"rope_theta": 10000.0})
        else:
            overrides["rope_theta"], overrides["rope_scaling"] = rope_settings(
                {**cfg, "rope_theta": cfg.get("rope_theta", 1e6)}
            )
            local = (float(cfg.get("rope_local_base_freq", 10000.0)), None)
        overrides["qk_norm"] = True
    window = cfg.get("sliding_window") if SLIDING in kinds else None
    if SLIDING in kinds and not window:
        raise UnsupportedModel("Gemma sliding-window layers without a sliding_window")
    arch = GemmaArch(
        version=version,
        layer_kinds=kinds,
        window=window,
        query_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5
        if version > 1
        else head_dim**-0.5,
        attn_softcap=cfg.get("attn_logit_softcapping") if version > 1 else None,
        final_softcap=cfg.get("final_logit_softcapping") if version > 1 else None,
        act=ACTIVATIONS[act_name],
        local_rope=local,
    )
    return ModelConfig.base(cfg, arch=arch, **overrides)


def _offset_norm(ck: Checkpoint, name: str) -> torch.Tensor:
    """A Gemma norm weight as the multiplier it means: 1 + w, in fp32 (as transformers adds it)."""
    return (1.0 + ck.take(name).float()).to(ck.device)


def build(spec: BuildSpec) -> DecoderModel:
    cfg = spec.cfg
    g: GemmaArch = cfg.arch
    ck = Checkpoint(spec.model_dir, spec.dtype, spec.device, spec.quantization)
    a8 = spec.quantization in ACT_INT8
    root = ck.root
    layers = []
    for i in range(cfg.num_layers):
        p = f"{root}layers.{i}."
        bias = None
        if cfg.attention_bias:
            bias = ck.put(torch.cat([ck.take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
        qkv = ck.matrix(p + "qkv", [p + f"self_attn.{x}_proj.weight" for x in "qkv"])
        gate_up = ck.matrix(p + "gate_up", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        sandwich = g.version > 1
        layers.append(
            DecoderLayer(
                input_norm=_offset_norm(ck, p + "input_layernorm.weight"),
                qkv=make_linear(qkv, bias, a8),
                o=make_linear(ck.matrix(p + "o", [p + "self_attn.o_proj.weight"]), None, a8),
                post_attn_norm=_offset_norm(ck, p + "post_attention_layernorm.weight"),
                mlp=GatedMLP(
                    make_linear(gate_up, None, a8),
                    make_linear(ck.matrix(p + "down", [p + "mlp.down_proj.weight"]), None, a8),
                    g.act,
                ),
                kind=g.layer_kinds[i],
                pre_ff_norm=_offset_norm(ck, p + "pre_feedforward_layernorm.weight")
                if sandwich
                else None,
                post_ff_norm=_offset_norm(ck, p + "post_feedforward_layernorm.weight")
                if sandwich
                else None,
                q_norm=_offset_norm(ck, p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
                k_norm=_offset_norm(ck, p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
            )
        )
    embed_src = ck.take(f"{root}embed_tokens.weight")
    embed = ck.put(embed_src)
    lm_head = ck.lm_head(embed_src, embed, cfg.tie_word_embeddings)
    ropes = {
        FULL: Rope(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            spec.max_model_len,
            spec.dtype,
            spec.device,
        )
    }
    if g.local_rope is not None:
        ropes[SLIDING] = Rope(
            cfg.head_dim, *g.local_rope, spec.max_model_len, spec.dtype, spec.device
        )
    dspec = DecoderSpec(
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        eps=cfg.rms_norm_eps,
        layer_kinds=g.layer_kinds,
        window=g.window,
        query_scale=g.query_scale,
        attn_softcap=g.attn_softcap,
        final_softcap=g.final_softcap,
        embed_scale=cfg.hidden_size**0.5,
        sandwich=g.version > 1,
    )
    norm = _offset_norm(ck, f"{root}norm.weight")
    return DecoderModel(dspec, layers, embed, norm, LogitsHead(lm_head), ropes)


_REFUSED_Q = (("int8-w8a8", "its smoothing is written for the Llama family's layers"),)
ARCHITECTURES = {
    t: Architecture(name, parse, build, _REFUSED_Q)
    for t, name in (("gemma", "Gemma"), ("gemma2", "Gemma 2"), ("gemma3_text", "Gemma 3"))
}
