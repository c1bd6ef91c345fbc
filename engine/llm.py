"""Offline API mirroring vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.embed import Pooling
from engine.lora import LoRARequest, read_adapter
from engine.request import Priority
from engine.sampling_params import SamplingParams
from protocol.logprobs import TokenLogprob


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _prompt_list(
    prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
) -> list[str | Sequence[int]]:
    """One prompt (a string or token ids) alone, or a sequence of prompts, as a list of prompts."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [cast("str | Sequence[int]", prompts)]  # one prompt: its first item is an id
    return list(cast("Sequence[str | Sequence[int]]", prompts))  # not a string nor ids


class LLM:
    """`LLM(model=..., **EngineConfig fields)`, e.g. `LLM("smollm2-135m-instruct",
    quantization="int4")` for weight-only int4 linears (see engine/quant.py; `duet models pull
    --quantize` caches them)."""

    def __init__(self, model: str = EngineConfig.model, **kwargs: Any) -> None:
        self.engine = EngineCore(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Priority = Priority.INTERACTIVE,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """Run `prompts` (strings or token-id lists) to completion; outputs in input order.
        `lora_request` (vLLM's): the adapter of every prompt, or one per prompt (None: the base
        model); an adapter is loaded from its path the first time its name is seen (the engine
        needs max_loras > 0)."""
        plist = _prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        ps = [params] * len(plist) if isinstance(params, SamplingParams) else list(params)
        if len(ps) != len(plist):
            raise ValueError(f"{len(ps)} SamplingParams for {len(plist)} prompts")
        if lora_request is not None:
            ps = self._with_adapters(ps, lora_request)
        # Distinct guides compile together on the compile pool (the core then finds them cached).
        guides = {(p.guide, p.cache_salt) for p in ps if p.guide is not None}
        concurrent.futures.wait(
            [self.engine.guides.compile_async(g, salt) for g, salt in guides]
        )  # errors: at add_request
        results: dict[str, CompletionOutput] = {}
        order = []
        for prompt, p in zip(plist, ps, strict=True):
            rid = f"llm-{next(self._ids)}"
            req = self.engine.add_request(
                rid, prompt if isinstance(prompt, str) else list(prompt), p, priority
            )
            results[rid] = CompletionOutput(rid, req.prompt_token_ids)
            order.append(rid)
        pending = set(order)
        while pending:
            outputs, _ = self.engine.step()
            for o in outputs:
                r = results[o.request_id]
                r.token_ids.extend(o.new_token_ids)
                r.text += o.new_text
                if o.logprobs is not None:
                    r.logprobs = (r.logprobs or []) + o.logprobs
                if o.prompt_logprobs is not None:
                    r.prompt_logprobs = o.prompt_logprobs
                if o.finished:
                    r.finish_reason, r.stop_reason = o.finish_reason, o.stop_reason
                    r.num_cached_tokens = o.num_cached_tokens
                    pending.discard(o.request_id)
        return [results[rid] for rid in order]

    def _with_adapters(
        self,
        ps: list[SamplingParams],
        lora: LoRARequest | Sequence[LoRARequest | None],
    ) -> list[SamplingParams]:
        loras = [lora] * len(ps) if isinstance(lora, LoRARequest) else list(lora)
        if len(loras) != len(ps):
            raise ValueError(f"{len(loras)} LoRA requests for {len(ps)} prompts")
        for r in {r for r in loras if r is not None}:
            self.load_lora(r)
        return [
            p if r is None else dataclasses.replace(p, lora_name=r.lora_name)
            for p, r in zip(ps, loras, strict=True)
        ]

    def load_lora(self, request: LoRARequest) -> list[str]:
        """Load `request`'s adapter unless its name is loaded; returns the adapters unloaded
        to make room (least recently used, idle)."""
        core = self.engine
        if request.lora_name in core.lora_names():
            return []
        cfg, rank = core.model_config, core.config.max_lora_rank
        return core.load_lora(read_adapter(request.lora_name, request.lora_path, cfg, rank))

    def embed(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        pooling: str = "last",
        dimensions: int | None = None,
    ) -> list[list[float]]:
        """L2-normalized embeddings of `prompts` (strings or token-id lists; engine/embed.py), in
        input order: `pooling` "last" (the last token's final hidden state) or "mean"."""
        tok = self.engine.tokenizer
        ids = [tok.encode(p) if isinstance(p, str) else list(p) for p in _prompt_list(prompts)]
        return self.engine.embed(ids, Pooling(pooling), dimensions).tolist()
