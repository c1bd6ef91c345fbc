"""Load weights from safetensors into the engine's fused layout (`Checkpoint`, which every
architecture's loader uses), and the Llama family's layers (`load_weights`).

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
#: `Checkpoint.matrix`'s default scheme: the checkpoint's own quantization
_SAME = "same"


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


class Checkpoint:
    """A model directory's safetensors, taken tensor by tensor into the engine's layout: `take`
    pops a raw tensor (a missing one is an error naming it), `put` casts one to the engine dtype
    and device, `matrix` fuses (and quantizes) linear weights. Every architecture's loader
    (engine/models/) reads through one of these."""

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str | None = None,
        use_cache: bool = True,
    ) -> None:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self.model_dir = Path(model_dir)
        self.dtype, self.device = dtype, device
        self.raw: dict[str, torch.Tensor] = {}
        for f in files:
            self.raw.update(load_file(str(f)))
        if quantization in ("none", ""):
            quantization = None
        self.cached: dict[str, QuantizedWeight] = {}
        self.t0 = time.monotonic()
        #: int8-w8a8 quantizes its weight format's matrices after smoothing them
        #: (engine/quant_smooth.py), so the weight-only cache does not hold them
        self.smooth = quantization in SMOOTHED_SCHEMES
        #: the weight format the linears are quantized to (None: the engine dtype)
        self.quantization = None
        if quantization is not None:
            self.quantization = WEIGHT_FORMAT[check_scheme(quantization)]
            self.cached = (
                load_quantized(model_dir, self.quantization)
                if use_cache and not self.smooth
                else None
            ) or {}

    def has(self, name: str) -> bool:
        return name in self.raw

    def take(self, name: str) -> torch.Tensor:
        try:
            return self.raw.pop(name)
        except KeyError:
            raise KeyError(f"{self.model_dir}: weight {name!r} missing") from None

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def tensor(self, name: str) -> torch.Tensor:
        """A raw tensor in the engine dtype (norms, embeddings, biases)."""
        return self.put(self.take(name))

    def matrix(self, name: str, parts: list[str], scheme: str | None = _SAME) -> Matrix:
        """A linear weight: the cached quantized copy, else the source parts fused (and
        quantized); `scheme` overrides the checkpoint's quantization (the lm_head's)."""
        if scheme is _SAME:
            scheme = self.quantization
        if scheme is not None and name in self.cached:
            for p in parts:
                self.raw.pop(p, None)
            return self.cached[name].to(self.device)
        return self.fused(name, [self.take(p) for p in parts], scheme)

    def fused(self, name: str, tensors: list[torch.Tensor], scheme: str | None = _SAME) -> Matrix:
        """`matrix` over tensors already taken (rows of a stacked expert tensor, a split one)."""
        if scheme is _SAME:
            scheme = self.quantization
        if scheme is None:
            return self.put(torch.cat(tensors) if len(tensors) > 1 else tensors[0])
        if name in self.cached:
            return self.cached[name].to(self.device)
        w = torch.cat(tensors)
        if scheme.startswith("int4") and w.shape[1] % 64:
            log.warning(
                "%s: in_features %d is not a multiple of 64; int8 instead of %s",
                name,
                w.shape[1],
                scheme,
            )
            scheme = "int8"
        return quantize(w, scheme).to(self.device)

    @property
    def root(self) -> str:
        """A base-model checkpoint (Qwen3-Embedding saved as Qwen3Model) names its weights without
        the causal LM's "model." prefix, and has no lm_head (tied to the embedding)."""
        raw = self.raw
        if "model.embed_tokens.weight" not in raw and "embed_tokens.weight" in raw:
            return ""
        return "model."

    def lm_head(self, embed_src: torch.Tensor, embed: torch.Tensor, tied: bool) -> Matrix:
        """The output matrix: the embedding when `tied` (or when the checkpoint has none),
        quantized with the weight format's lm_head scheme."""
        tied = tied or "lm_head.weight" not in self.raw
        if self.quantization is None:
            return embed if tied else self.tensor("lm_head.weight")
        if tied:
            self.raw["lm_head.weight"] = embed_src
        return self.matrix("lm_head", ["lm_head.weight"], LM_HEAD_SCHEME[self.quantization])

    def log_quantized(self, mats: list[Matrix]) -> None:
        if self.quantization is None:
            return
        log.info(
            "weights quantized to %s: %.1f MiB of linear weights, %s in %.1f s",
            self.quantization,
            sum(m.nbytes for m in mats if isinstance(m, QuantizedWeight)) / 2**20,
            "read from the cache" if self.cached else "quantized at load",
            time.monotonic() - self.t0,
        )


#: the names of a layer's linears in a checkpoint: parts fused into qkv and gate_up
LLAMA_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
LLAMA_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")


def load_weights(
    model_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    use_cache: bool = True,
    qkv_parts: tuple[str, ...] = LLAMA_QKV,
    gate_up_parts: tuple[str, ...] = LLAMA_GATE_UP,
) -> ModelWeights:
    """The Llama family's weights (and Phi-3's, whose checkpoints fuse qkv and gate_up already:
    `qkv_parts` / `gate_up_parts` name what a layer's two fused matrices are made of)."""
    ck = Checkpoint(model_dir, dtype, device, quantization, use_cache)
    root = ck.root
    if ck.smooth:
        from engine.quant_smooth import smooth_checkpoint

        smooth_checkpoint(ck.raw, Path(model_dir), cfg, root)
    layers = []
    for i in range(cfg.num_layers):
        p = f"{root}layers.{i}."
        bias = None
        if cfg.attention_bias:
            bias = ck.put(torch.cat([ck.take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
        layers.append(
            LayerWeights(
                input_norm=ck.tensor(p + "input_layernorm.weight"),
                qkv=ck.matrix(p + "qkv", [p + n for n in qkv_parts]),
                qkv_bias=bias,
                o=ck.matrix(p + "o", [p + "self_attn.o_proj.weight"]),
                post_norm=ck.tensor(p + "post_attention_layernorm.weight"),
                gate_up=ck.matrix(p + "gate_up", [p + n for n in gate_up_parts]),
                down=ck.matrix(p + "down", [p + "mlp.down_proj.weight"]),
                q_norm=ck.tensor(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
                k_norm=ck.tensor(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
            )
        )
    embed_src = ck.take(f"{root}embed_tokens.weight")
    embed = ck.put(embed_src)
    lm_head = ck.lm_head(embed_src, embed, cfg.tie_word_embeddings)
    ck.log_quantized([lm_head, *(m for lw in layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down))])
    return ModelWeights(
        embed=embed, layers=layers, norm=ck.tensor(f"{root}norm.weight"), lm_head=lm_head
    )
