"""Engine adapters behind the node seam (node.engine_api); `make_engine` picks one by name.

Each adapter lives in its own module and is imported only when chosen, so a node that runs
the native engine never imports vLLM and vice versa.
"""

from __future__ import annotations

from typing import Any

from node.engine_api import NodeEngine

ENGINES = ("native", "vllm")


def make_engine(kind: str, config: Any) -> NodeEngine:
    """Build (not start) the engine `kind` from its config."""
    if kind == "native":
        from node.engines.native import NativeNodeEngine

        return NativeNodeEngine(config)
    if kind == "vllm":
        from node.engines.vllm import VllmNodeEngine

        return VllmNodeEngine(config)
    raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")
