"""Multi-LoRA: PEFT adapters read at run time (adapter.py) into slots every step applies at once,
each token with its own adapter (slots.py)."""

from engine.lora.adapter import LoraAdapter, LoraError, LoRARequest, read_adapter
from engine.lora.slots import LoraSlots, LoraSlotsFull

__all__ = ["LoRARequest", "LoraAdapter", "LoraError", "LoraSlots", "LoraSlotsFull", "read_adapter"]
