"""The LoRA adapters resident in one engine, and how one step applies each token's own adapter.

Slots: `max_loras` of them, each holding one adapter at rank up to `max_lora_rank` (a smaller
rank is zero-padded). Every part of every fused linear of every layer (q, k, v of qkv; o; gate,
up of gate_up; down) keeps all slots stacked: A [slots · R, in] and B [slots · R, out_part] with
the scale folded in; a slot that does not adapt a part holds zeros there.

One step, every adapter at once (no loop over tokens or over adapters): the runner gives each
token of the step its slot (-1: the base model), and each adapted part adds
    ((x · A[:k·R]ᵀ) ⊙ mask) · B[:k·R]
to the base linear's output columns, in place, where k is one past the highest slot the step
uses and the mask keeps, for each token, the R columns of its own slot (zeros elsewhere, so the
others' products drop out). A step with no adapted token skips it all. Cost per token: k · R
columns per part on top of the base GEMM (k · R = 64 for 8 adapters of rank 8).

Residency: `install` puts an adapter in a free slot, or in the least recently used slot whose
adapter no queued or running request names (`acquire`/`release` count them); when every slot is
taken by adapters in use it refuses (LoraSlotsFull: retry later). Adapters change only between
steps (the engine thread), so a step never sees half an adapter. An adapter name keeps the
weights it was loaded with: loading other weights under a loaded name is refused (unload first),
and `digest_changed` tells the engine when a name comes back with other weights than it had
(its cached KV is not the new adapter's).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from engine.lora.adapter import LoraAdapter, LoraError
from engine.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.linear import Linear
    from engine.qlinear import QLinear


class AdaptedModel(Protocol):
    """What `LoraSlots.attach` reads of a model of any family (engine/models): its layers."""

    layers: list[Any]


class LoraSlotsFull(RuntimeError):
    """Every slot holds an adapter that queued or running requests use: retry later."""


@dataclass
class LoraBatch:
    """This step's token → slot map, as the adapted linears read it (None: no adapted token)."""

    #: [T, k · R] in the model dtype: 1 where column c belongs to token t's slot (c // R)
    mask: torch.Tensor | None = None
    k: int = 0


class _Stack:
    """One fused linear's slots (see the module docstring): per part, A [slots · R, in] and
    B · scale [slots · R, out_part], slot s in rows [s · R, (s + 1) · R)."""

    def __init__(
        self,
        parts: list[tuple[str, int, int]],
        in_features: int,
        slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.parts, self.rank = parts, rank
        n = slots * rank
        self.a = [torch.zeros(n, in_features, dtype=dtype, device=device) for _ in parts]
        self.b = [torch.zeros(n, hi - lo, dtype=dtype, device=device) for _, lo, hi in parts]

    def write(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` := the adapter's (A, B·scale) per part (zeros for the parts it lacks)."""
        rows = slice(slot * self.rank, (slot + 1) * self.rank)
        for j, (name, _, _) in enumerate(self.parts):
            a_rows, b_rows = self.a[j][rows], self.b[j][rows]
            a_rows.zero_()
            b_rows.zero_()
            if name in pairs:
                a, b = pairs[name]
                a_rows[: a.shape[0]].copy_(a)
                b_rows[: b.shape[1]].copy_(b.t())

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> None:
        """out[:, part] += ((x · A[:kR]ᵀ) ⊙ mask) · B[:kR] for each part: three ops a part, no
        copies (the product of the step's slots only, masked in place, added in place)."""
        n, mask = batch.k * self.rank, batch.mask
        assert mask is not None  # LoraLinear adds deltas only for a step with adapted tokens
        for j, (_, lo, hi) in enumerate(self.parts):
            xa = F.linear(x, self.a[j][:n]).mul_(mask)
            out[:, lo:hi].addmm_(xa, self.b[j][:n])


class LoraLinear:
    """A base linear (Linear or QLinear) plus its slots' deltas for the step's tokens; reads
    like the base linear (in_features, decode_bytes, ...)."""

    def __init__(self, base: Linear | QLinear, stack: _Stack, batch: LoraBatch) -> None:
        self.base, self.stack, self.batch = base, stack, batch

    def __getattr__(self, name: str) -> object:
        return getattr(self.base, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.batch.mask is not None:
            self.stack.add_delta(x, out, self.batch)
        return out


def fused_parts(cfg: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Per fused linear, its parts: (adapter module name, first output column, end)."""
    d, h, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    if cfg.model_type == "phi3":
        qkv, gate_up = [("qkv_proj", 0, q + 2 * kv)], [("gate_up_proj", 0, 2 * inter)]
    else:
        qkv = [("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)]
        gate_up = [("gate_proj", 0, inter), ("up_proj", inter, 2 * inter)]
    return {"qkv": qkv, "o": [("o_proj", 0, h)], "gate_up": gate_up, "down": [("down_proj", 0, h)]}


def _owners(layer: object) -> dict[str, tuple[object, str]]:
    """Where each fused linear of a layer lives (LlamaModel's Layer, DecoderModel's layer with a
    dense MLP; a mixture-of-experts MLP has none)."""
    out: dict[str, tuple[object, str]] = {"qkv": (layer, "qkv"), "o": (layer, "o")}
    mlp = getattr(layer, "mlp", layer)
    if hasattr(mlp, "gate_up") and hasattr(mlp, "down"):
        out["gate_up"], out["down"] = (mlp, "gate_up"), (mlp, "down")
    return out


@dataclass
class LoraSlots:
    cfg: ModelConfig
    max_loras: int
    max_rank: int
    dtype: torch.dtype
    device: torch.device
    batch: LoraBatch = field(default_factory=LoraBatch)
    #: slot → adapter name (None: free)
    slots: list[str | None] = field(init=False)
    adapters: dict[str, LoraAdapter] = field(default_factory=dict)
    #: requests (queued or running) per adapter name: those adapters are never evicted
    in_use: Counter[str] = field(default_factory=Counter)
    last_used: dict[str, float] = field(default_factory=dict)
    #: the weights' digest each name was last loaded with
    digests: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self.slots = [None] * self.max_loras
        parts = fused_parts(self.cfg)
        ins = {"qkv": self.cfg.hidden_size, "o": self.cfg.num_heads * self.cfg.head_dim}
        ins |= {"gate_up": self.cfg.hidden_size, "down": self.cfg.intermediate_size}
        self.stacks: list[dict[str, _Stack]] = [
            {
                name: _Stack(
                    parts[name], ins[name], self.max_loras, self.max_rank, self.dtype, self.device
                )
                for name in parts
            }
            for _ in range(self.cfg.num_layers)
        ]

    # -- the model ---------------------------------------------------------------------------
    def attach(self, model: AdaptedModel) -> None:
        """Wrap the model's adapted linears (a freshly built model: at start, and after a wake).
        Layers with a mixture-of-experts MLP keep their stacks for gate_up/down unused."""
        for i, layer in enumerate(model.layers):
            owners = _owners(layer)
            for name, stack in self.stacks[i].items():
                if name in owners:  # else no dense linear: `install` refuses adapters there
                    obj, attr = owners[name]
                    setattr(obj, attr, LoraLinear(getattr(obj, attr), stack, self.batch))
        # the one-C-call decode loop would skip the wrappers
        if getattr(model, "decode_plan", None) is not None:
            model.decode_plan = None  # type: ignore[attr-defined]  # LlamaModel's only
        self._dense = [set(_owners(layer)) for layer in model.layers]

    # -- residency ---------------------------------------------------------------------------
    def digest_changed(self, adapter: LoraAdapter) -> bool:
        """Whether this name was loaded before with other weights (its cached KV is stale)."""
        old = self.digests.get(adapter.name)
        return old is not None and old != adapter.digest

    def install(self, adapter: LoraAdapter) -> list[str]:
        """Put `adapter` in a slot; returns the names evicted for it (LRU, unused only)."""
        name = adapter.name
        if name in self.adapters:
            if self.adapters[name].digest != adapter.digest:
                raise LoraError(
                    f"adapter {name!r} is loaded with other weights: unload it first, or load "
                    "these under a new name"
                )
            self.last_used[name] = time.monotonic()
            return []
        parts_of = fused_parts(self.cfg)
        for (layer, module), _ in adapter.weights.items():
            fused = next(f for f, ps in parts_of.items() if any(p[0] == module for p in ps))
            if fused not in self._dense[layer]:
                raise LoraError(
                    f"adapter {name!r} adapts {module} of layer {layer}, whose MLP is a mixture "
                    "of experts (the engine adapts dense projections only)"
                )
        evicted: list[str] = []
        if None not in self.slots:
            idle = [n for n in self.adapters if not self.in_use[n]]
            if not idle:
                raise LoraSlotsFull(
                    f"all {self.max_loras} LoRA slots hold adapters that queued or running "
                    "requests use; retry when one is idle"
                )
            victim = min(idle, key=lambda n: self.last_used.get(n, 0.0))
            self.remove(victim)
            evicted.append(victim)
        slot = self.slots.index(None)
        for i, stacks in enumerate(self.stacks):
            for stack in stacks.values():
                stack.write(
                    slot, {m: ab for (layer, m), ab in adapter.weights.items() if layer == i}
                )
        self.slots[slot] = name
        self.adapters[name] = adapter
        self.digests[name] = adapter.digest
        self.last_used[name] = time.monotonic()
        return evicted

    def remove(self, name: str) -> bool:
        """Free the adapter's slot (False: not loaded); the caller checks it is not in use."""
        if name not in self.adapters:
            return False
        self.slots[self.slots.index(name)] = None
        del self.adapters[name]
        self.last_used.pop(name, None)
        return True

    def slot_of(self, name: str) -> int:
        if name not in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is not loaded")
        return self.slots.index(name)

    def acquire(self, name: str) -> None:
        self.slot_of(name)
        self.in_use[name] += 1
        self.last_used[name] = time.monotonic()

    def release(self, name: str) -> None:
        self.in_use[name] -= 1
        if self.in_use[name] <= 0:
            del self.in_use[name]

    # -- the step ----------------------------------------------------------------------------
    def begin_step(self, token_slots: list[int]) -> None:
        """Set the step's token → slot map (-1: the base model) for the adapted linears."""
        k = max(token_slots, default=-1) + 1
        if k == 0:
            self.batch.mask, self.batch.k = None, 0
            return
        slots = torch.tensor(token_slots, device=self.device)
        cols = torch.arange(k * self.max_rank, device=self.device) // self.max_rank
        self.batch.mask = (slots[:, None] == cols[None, :]).to(self.dtype)
        self.batch.k = k

    def end_step(self) -> None:
        self.batch.mask, self.batch.k = None, 0
