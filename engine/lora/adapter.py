"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
into per-layer, per-module (A, B·scale) pairs, checked against the base model.

What runs: plain LoRA on the attention and MLP projections (q/k/v/o, gate/up/down; Phi-3's fused
qkv_proj / gate_up_proj), any rank up to the engine's `max_lora_rank`, scale alpha / r
(alpha / √r with rsLoRA), the layers it has weights for (`layers_to_transform`). Anything else an
adapter can carry changes what the model computes in a way the engine does not reproduce, so it
is refused with the reason, before the adapter takes a slot: DoRA, LoRA biases, modules saved in
full (`modules_to_save`), per-module ranks or alphas, adapted embeddings or lm_head, expert
matrices of a mixture of experts, a shape that is not the base model's.

Pure file work (no engine state): the node runs it off the engine thread, so loading an adapter
costs the running batch nothing but the final copy into a slot (engine/lora/slots.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model_config import ModelConfig


class LoraError(ValueError):
    """An adapter the engine refuses (unreadable, or not what it can apply)."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: the adapter a request runs with, loaded from `lora_path` the first time
    its name is seen (`lora_int_id` is accepted for vLLM's signature and not used)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


#: module name → the fused linear it belongs to, for Llama-named checkpoints and Phi-3's
LLAMA_MODULES = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "down_proj": "down",
}
PHI3_MODULES = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
#: adapter_config.json settings that must be off (their value when off)
_OFF = {
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "target_parameters": None,
    "trainable_token_indices": None,
    "layer_replication": None,
}


@dataclass
class LoraAdapter:
    name: str
    path: Path
    rank: int
    #: sha256 of the weights file: the same name loaded again with other weights is another
    #: adapter (its cached KV is not this one's)
    digest: str
    #: (layer, module name) → (A [r, in], B · scale [out, r]), fp32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every module an adapter may target on this model."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    inter = cfg.intermediate_size
    shapes = {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }
    if cfg.model_type == "phi3":
        return {
            "qkv_proj": (q + 2 * kv, h),
            "o_proj": (h, q),
            "gate_up_proj": (2 * inter, h),
            "down_proj": (h, inter),
        }
    return shapes


def _config(path: Path) -> dict:
    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise LoraError(
            f"{path} has no adapter_config.json (not a PEFT adapter directory)"
        ) from None
    except (OSError, ValueError) as e:
        raise LoraError(f"cannot read {path / 'adapter_config.json'}: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path} is a {cfg.get('peft_type')} adapter; the engine applies LoRA only")
    for key, off in _OFF.items():
        if cfg.get(key, off) not in (off, None, {}, [], False):
            raise LoraError(f"the adapter sets {key}={cfg[key]!r}, which the engine does not apply")
    return cfg


def read_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at `path` for the base model `cfg` (LoraError if refused)."""
    path = Path(path)
    if not path.is_dir():
        raise LoraError(f"adapter path {str(path)!r} is not a directory on this node")
    conf = _config(path)
    files = [path / "adapter_model.safetensors"]
    if not files[0].is_file():
        raise LoraError(f"{path} has no adapter_model.safetensors")
    raw = load_file(str(files[0]))
    digest = hashlib.sha256(files[0].read_bytes()).hexdigest()
    shapes = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in shapes:
            raise LoraError(
                f"the adapter adapts {key!r}; the engine applies LoRA to {sorted(shapes)} of the "
                "decoder layers only (no embeddings, lm_head or expert matrices)"
            )
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoraError(f"{key!r}: the base model has {cfg.num_layers} layers")
        pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = t.float()
    if not pairs:
        raise LoraError(f"{path}: the adapter has no LoRA weights")
    r = int(conf.get("r", 8))
    if not 0 < r <= max_rank:
        raise LoraError(f"the adapter's rank {r} exceeds this engine's max_lora_rank {max_rank}")
    alpha = float(conf.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        a, b = ab.get("A"), ab.get("B")
        out_f, in_f = shapes[module]
        if a is None or b is None or a.shape != (r, in_f) or b.shape != (out_f, r):
            got = {k: tuple(v.shape) for k, v in ab.items()}
            raise LoraError(
                f"layer {layer} {module}: LoRA A/B shapes {got} do not fit the base model "
                f"(A {(r, in_f)}, B {(out_f, r)})"
            )
        weights[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
    return LoraAdapter(name=name, path=path, rank=r, digest=digest, weights=weights)
