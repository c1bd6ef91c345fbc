"""vLLM's engine statistics under duet's names (the keys of NodeEngine.stats(), which
node.metrics exports as `duet:*` on /metrics and the KV event stream sends in load frames).

vLLM reports per step to its stat loggers (`SchedulerStats`, `IterationStats`); `VllmStats`
keeps the last gauges and sums the counters, and `logger_factory` gives AsyncLLM a logger that
feeds it. Mapping:

    num_running_reqs → num_requests_running      kv_cache_usage → kv_cache_usage_perc
    num_waiting_reqs → num_requests_waiting      prefix_cache_stats.queries/hits → prefix_cache_*
    prompt_token_stats.computed → prompt_tokens_computed
    num_generation_tokens → generation_tokens    num_preempted_reqs → num_preemptions
    finished with reason "error" → num_requests_failed
    vLLM's pool in duet's blocks → kv_blocks_total (kv_blocks_free from the usage)

vLLM's classes are imported only inside `logger_factory` (this module loads without vLLM).
"""

from __future__ import annotations

from typing import Any


class VllmStats:
    def __init__(self) -> None:
        self.values: dict[str, float] = {
            "num_requests_running": 0,
            "num_requests_waiting": 0,
            "kv_cache_usage_perc": 0.0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "prompt_tokens_computed": 0,
            "generation_tokens": 0,
            "num_preemptions": 0,
            "num_requests_failed": 0,
            "kv_blocks_total": 0,
            "kv_blocks_free": 0,
            "num_requests_held": 0,
            "queue_full": 0,
        }

    def set_capacity(self, blocks: int) -> None:
        self.values["kv_blocks_total"] = blocks
        self.values["kv_blocks_free"] = blocks

    def record(self, scheduler: Any, iteration: Any) -> None:
        v = self.values
        if scheduler is not None:
            v["num_requests_running"] = scheduler.num_running_reqs
            v["num_requests_waiting"] = scheduler.num_waiting_reqs
            v["kv_cache_usage_perc"] = float(scheduler.kv_cache_usage)
            v["kv_blocks_free"] = round(
                v["kv_blocks_total"] * (1.0 - float(scheduler.kv_cache_usage))
            )
            pc = scheduler.prefix_cache_stats
            if pc is not None:
                v["prefix_cache_queries"] += pc.queries
                v["prefix_cache_hits"] += pc.hits
        if iteration is not None:
            v["generation_tokens"] += iteration.num_generation_tokens
            v["prompt_tokens_computed"] += getattr(iteration.prompt_token_stats, "computed", 0)
            v["num_preemptions"] += iteration.num_preempted_reqs
            v["num_requests_failed"] += sum(
                1
                for f in iteration.finished_requests
                if str(getattr(f, "finish_reason", "")).lower().endswith("error")
            )

    def snapshot(self) -> dict[str, float]:
        return dict(self.values)


def logger_factory(stats: VllmStats) -> Any:
    """A vLLM per-engine StatLoggerFactory that records into `stats`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class DuetStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass  # the adapter sets the capacity (in duet's blocks) once vLLM has sized its pool

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            stats.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return DuetStatLogger
