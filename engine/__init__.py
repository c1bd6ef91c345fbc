"""The native paged-KV engine (DESIGN.md §3): pure compute, no HTTP, etcd or NIXL inside.

Offline use mirrors vLLM: `from engine import LLM, SamplingParams` (and `LoRARequest`). Node servers use
`AsyncEngine` (engine.async_engine) through the node seam (node/engine_api.py, adapter
node/engines/native.py).
"""

from engine.config import EngineConfig
from engine.llm import LLM, CompletionOutput
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LoRARequest", "SamplingParams"]
