"""The native paged-KV engine (DESIGN.md §3): pure compute, no HTTP, etcd or NIXL inside.

Offline use mirrors vLLM: `from engine import LLM, SamplingParams` (and `LoRARequest`). Node
servers use `AsyncEngine` (engine.async_engine) through the node seam (node/engine_api.py,
adapter node/engines/native.py).

The names are imported on first use: `import engine.config` (which the CLI does to build its
flags from `EngineConfig`) must not import torch, whose import costs seconds on every `duet`
command that never runs the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM, CompletionOutput
    from engine.lora import LoRARequest
    from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LoRARequest", "SamplingParams"]

_HOMES = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.llm",
    "EngineConfig": "engine.config",
    "LoRARequest": "engine.lora",
    "SamplingParams": "engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
