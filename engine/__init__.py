"""The native paged-KV engine (DESIGN.md §3): pure compute, no HTTP, etcd or NIXL inside.

Offline use mirrors vLLM: `from engine import LLM, SamplingParams`. Node servers use
`AsyncEngine` (engine.async_engine) through the seam in `engine.protocol`.
"""

from engine.config import EngineConfig
from engine.llm import LLM, CompletionOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "SamplingParams"]
