"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, on DecoderModel (engine/models/decoder.py).

Attention is Llama's (Qwen3-MoE: with Qwen3's per-head q/k norms); each MoE layer's MLP is `MoE`:
a router (a linear to one logit per expert), softmax in fp32, the top-k experts per token
(Mixtral always renormalizes their weights to sum to 1, Qwen3-MoE when `norm_topk_prob`), and
the token's output Σ weight_e · down_e(silu(gate_e(x)) · up_e(x)). Qwen3-MoE layers listed in
`mlp_only_layers`, or off its `decoder_sparse_step`, keep a dense SwiGLU MLP.

Batched expert GEMMs: the step's (token, expert) pairs are sorted by expert once, and each expert
that any token chose runs one GEMM pair over all of its tokens (a loop over experts, never over
tokens), its outputs scaled by the routing weights and added back with one index_add. Experts
are summed per token in ascending expert order, as transformers does.

Checkpoints: per-expert matrices (`experts.{e}.gate_proj`/`up_proj`/`down_proj`, Mixtral's
`w1`/`w3`/`w2`), or the stacked form transformers 5 uses in memory (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]). Each expert's gate/up are fused into one linear, and
quantization (weight-only and int4-w4a8) applies per expert; the router stays in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.logits_head import LogitsHead
from engine.model_config import ModelConfig, UnsupportedModel
from engine.models import Architecture, BuildSpec
from engine.models.decoder import (
    FULL,
    DecoderLayer,
    DecoderModel,
    DecoderSpec,
    GatedMLP,
    LinearLike,
    MLPBlock,
)
from engine.qlinear import make_linear
from engine.quant import ACT_INT8
from engine.rope import Rope
from engine.weights import Checkpoint


@dataclass(frozen=True)
class MoEArch:
    num_experts: int
    top_k: int
    #: renormalize the top-k weights to sum to 1
    renormalize: bool
    expert_inter: int
    #: layers whose MLP is a mixture (the rest are dense SwiGLU)
    moe_layers: tuple[bool, ...]
    #: Qwen3-MoE casts the routing weights to the model dtype before scaling; Mixtral keeps fp32
    weights_in_model_dtype: bool


class MoE:
    def __init__(
        self,
        router: torch.Tensor,  # [E, hidden]
        experts: list[tuple[LinearLike, LinearLike]],  # (gate_up, down) per expert
        top_k: int,
        renormalize: bool,
        weights_in_model_dtype: bool,
    ) -> None:
        self.router, self.experts = router, experts
        self.top_k, self.renormalize = top_k, renormalize
        self.cast_weights = weights_in_model_dtype
        self.inter = experts[0][1].in_features

    @property
    def decode_bytes(self) -> int:
        return self.router.nbytes + sum(g.decode_bytes + d.decode_bytes for g, d in self.experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of each token's top-k experts."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top /= top.sum(dim=-1, keepdim=True)
        return (top.to(x.dtype) if self.cast_weights else top), ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        scale = weights.flatten()[order, None]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        at = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            rows = tokens[at : at + n]
            gate_up, down = self.experts[e]
            gu = gate_up(x[rows])
            y = down(F.silu(gu[:, : self.inter]) * gu[:, self.inter :])
            out.index_add_(0, rows, (y * scale[at : at + n]).to(out.dtype))
            at += n
        return out


def _num_experts(cfg: dict[str, Any]) -> int:
    n = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not n:
        raise UnsupportedModel(f"{cfg['model_type']} without a number of experts")
    return int(n)


def parse(cfg: dict[str, Any]) -> ModelConfig:
    t = cfg["model_type"]
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{t} with hidden_act {cfg['hidden_act']!r} (silu only)")
    n = cfg["num_hidden_layers"]
    if t == "qwen3_moe":
        if cfg.get("use_sliding_window"):
            raise UnsupportedModel("Qwen3-MoE with use_sliding_window")
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
        arch = MoEArch(
            num_experts=_num_experts(cfg),
            top_k=cfg["num_experts_per_tok"],
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            expert_inter=cfg["moe_intermediate_size"],
            moe_layers=moe_layers,
            weights_in_model_dtype=True,
        )
        return ModelConfig.base(cfg, qk_norm=True, sliding_window=None, arch=arch)
    arch = MoEArch(
        num_experts=_num_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        renormalize=True,
        expert_inter=cfg["intermediate_size"],
        moe_layers=(True,) * n,
        weights_in_model_dtype=False,
    )
    return ModelConfig.base(cfg, sliding_window=cfg.get("sliding_window"), arch=arch)


def _experts(
    ck: Checkpoint, p: str, mixtral: bool, n: int, a8: bool
) -> list[tuple[LinearLike, LinearLike]]:
    """Each expert's (gate_up, down) linears from per-expert or stacked checkpoint tensors."""
    out = []
    stacked = ck.has(p + "experts.gate_up_proj")
    if stacked:
        gu_all, down_all = ck.take(p + "experts.gate_up_proj"), ck.take(p + "experts.down_proj")
    for e in range(n):
        name = f"{p}experts.{e}."
        if stacked:
            gu = ck.fused(name + "gate_up", [gu_all[e]])
            down = ck.fused(name + "down", [down_all[e]])
        else:
            g, u, d = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            gu = ck.matrix(name + "gate_up", [f"{name}{g}.weight", f"{name}{u}.weight"])
            down = ck.matrix(name + "down", [f"{name}{d}.weight"])
        out.append((make_linear(gu, None, a8), make_linear(down, None, a8)))
    return out


def build(spec: BuildSpec) -> DecoderModel:
    cfg = spec.cfg
    m: MoEArch = cfg.arch
    mixtral = cfg.model_type == "mixtral"
    ck = Checkpoint(spec.model_dir, spec.dtype, spec.device, spec.quantization)
    a8 = spec.quantization in ACT_INT8
    root = ck.root
    block = (
        "block_sparse_moe."
        if mixtral and ck.has(f"{root}layers.0.block_sparse_moe.gate.weight")
        else "mlp."
    )
    layers = []
    for i in range(cfg.num_layers):
        p = f"{root}layers.{i}."
        bias = None
        if cfg.attention_bias:
            bias = ck.put(torch.cat([ck.take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
        qkv = ck.matrix(p + "qkv", [p + f"self_attn.{x}_proj.weight" for x in "qkv"])
        if m.moe_layers[i]:
            mlp: MLPBlock = MoE(
                ck.tensor(p + block + "gate.weight"),
                _experts(ck, p + block, mixtral, m.num_experts, a8),
                m.top_k,
                m.renormalize,
                m.weights_in_model_dtype,
            )
        else:
            gu = ck.matrix(p + "gate_up", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            dn = ck.matrix(p + "down", [p + "mlp.down_proj.weight"])
            mlp = GatedMLP(make_linear(gu, None, a8), make_linear(dn, None, a8), "silu")
        layers.append(
            DecoderLayer(
                input_norm=ck.tensor(p + "input_layernorm.weight").float(),
                qkv=make_linear(qkv, bias, a8),
                o=make_linear(ck.matrix(p + "o", [p + "self_attn.o_proj.weight"]), None, a8),
                post_attn_norm=ck.tensor(p + "post_attention_layernorm.weight").float(),
                mlp=mlp,
                q_norm=ck.tensor(p + "self_attn.q_norm.weight").float() if cfg.qk_norm else None,
                k_norm=ck.tensor(p + "self_attn.k_norm.weight").float() if cfg.qk_norm else None,
            )
        )
    embed_src = ck.take(f"{root}embed_tokens.weight")
    embed = ck.put(embed_src)
    lm_head = ck.lm_head(embed_src, embed, cfg.tie_word_embeddings)
    rope = Rope(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, spec.max_model_len, spec.dtype, spec.device
    )
    dspec = DecoderSpec(
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        eps=cfg.rms_norm_eps,
        layer_kinds=(FULL,) * cfg.num_layers,
    )
    norm = ck.tensor(f"{root}norm.weight").float()
    return DecoderModel(dspec, layers, embed, norm, LogitsHead(lm_head), {FULL: rope})


_REFUSED_Q = (("int8-w8a8", "its smoothing is written for the Llama family's dense layers"),)
ARCHITECTURES = {
    "qwen3_moe": Architecture("Qwen3-MoE", parse, build, _REFUSED_Q),
    "mixtral": Architecture("Mixtral", parse, build, _REFUSED_Q),
}
