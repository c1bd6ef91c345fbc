"""What an engine keeps resident beyond its pool's blocks: its weights (sleep mode, engine/
sleep.py) and its LoRA adapters (engine/lora/). A mixin of EngineCore: every method runs on the
engine thread, between steps, as the core's own do.

Sleep: `sleep` drops the weights (every runner's: the target's and a draft model's) and gives
the KV pool's pages back, only when the engine holds no request; `wake_up` rebuilds them, and is
what `add_request` and `embed` call on a sleeping engine. LoRA: `load_lora` takes an adapter read
off the engine thread (engine/lora/adapter.py) into a slot, `unload_lora` frees one no request
uses; requests name their adapter in SamplingParams.lora_name, checked by `lora_refusal`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engine.lora import LoraAdapter, LoraError
from engine.sleep import EngineBusy, SleepReport, drop_model, rebuild_model, release_pages

if TYPE_CHECKING:
    from engine.block_pool import BlockPool
    from engine.runner import ModelRunner
    from engine.scheduler import Scheduler
    from engine.spec_decode import Speculator

log = logging.getLogger("duet.engine")


class Residency:
    runner: ModelRunner
    pool: BlockPool
    scheduler: Scheduler
    speculator: Speculator | None
    sleeping: bool
    last_wake_s: float | None
    wakes: int

    # -- sleep mode (engine/sleep.py) -----------------------------------------------------
    def _runners(self) -> list[ModelRunner]:
        draft = self.speculator.model if self.speculator is not None else None
        return [self.runner] + ([draft.runner] if draft is not None else [])

    def sleep(self) -> SleepReport:
        """Drop the weights and give the KV pool's pages back (EngineBusy while any request is
        queued, running or held). Idempotent."""
        t0 = time.perf_counter()
        if self.sleeping:
            return SleepReport(0, 0, 0.0)
        if self.scheduler.requests or self.scheduler.held:
            n = len(self.scheduler.requests) + len(self.scheduler.held)
            raise EngineBusy(f"the engine holds {n} request(s); it sleeps only when idle")
        # the blocks' contents go, the spilled ones too: nothing may hit them after the wake
        self.scheduler.kv.reset_cache()
        weights = sum(drop_model(r) for r in self._runners())
        released = sum(release_pages(r.kv_cache) for r in self._runners())
        self.sleeping = True
        report = SleepReport(weights, released, time.perf_counter() - t0)
        log.info(
            "asleep: %.1f MiB of weights dropped, %.1f MiB of KV pool released in %.2f s",
            weights / 2**20,
            released / 2**20,
            report.seconds,
        )
        return report

    def wake_up(self) -> float:
        """Rebuild the weights (the next request would); returns the seconds it took."""
        if not self.sleeping:
            return 0.0
        t0 = time.perf_counter()
        for r in self._runners():
            rebuild_model(r)
        self.sleeping = False
        self.last_wake_s = time.perf_counter() - t0
        self.wakes += 1
        log.info("awake: weights rebuilt in %.2f s", self.last_wake_s)
        return self.last_wake_s

    # -- LoRA adapters ---------------------------------------------------------------------
    def lora_refusal(self, name: str) -> str | None:
        """Why a request cannot run with adapter `name` here (None: it can)."""
        lora = self.runner.lora
        if lora is None:
            return f"LoRA adapter {name!r} asked of an engine with LoRA off (max_loras 0)"
        if name not in lora.adapters:
            return f"LoRA adapter {name!r} is not loaded on this engine"
        return None

    def load_lora(self, adapter: LoraAdapter) -> list[str]:
        """Make `adapter` (read off this thread: engine/lora/adapter.py) resident; returns the
        adapters unloaded for it. LoraError / LoraSlotsFull when it cannot be."""
        lora = self.runner.lora
        if lora is None:
            raise LoraError("LoRA is off on this engine (start it with max_loras > 0)")
        stale = lora.digest_changed(adapter) and adapter.name not in lora.adapters
        # a name that served other weights before: its cached KV (pool and tiers) is not this
        # adapter's
        if stale and not self.scheduler.kv.reset_cache():
            raise LoraError(
                f"adapter {adapter.name!r} was served here with other weights and their KV "
                "is still cached; load these under a new name, or when the node is idle"
            )
        return lora.install(adapter)

    def unload_lora(self, name: str) -> bool:
        """Unload an adapter (False: not loaded); LoraError while requests use it."""
        lora = self.runner.lora
        if lora is None:
            return False
        if lora.in_use[name]:
            raise LoraError(f"adapter {name!r} is in use by {lora.in_use[name]} request(s)")
        return lora.remove(name)

    def residency_stats(self) -> dict[str, float]:
        lora = self.runner.lora
        return {
            "sleeping": float(self.sleeping),
            "wakes": self.wakes,
            "last_wake_seconds": self.last_wake_s or 0.0,
            "lora_adapters_loaded": 0 if lora is None else len(lora.adapters),
            "lora_slots": 0 if lora is None else lora.max_loras,
        }

    def lora_names(self) -> list[str]:
        return [] if self.runner.lora is None else sorted(self.runner.lora.adapters)
