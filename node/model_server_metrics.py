"""The model-server protocol's metrics: the names an endpoint picker scrapes (the Kubernetes
Gateway API Inference Extension's EPP, llm-d's), exported beside the node's own `duet:*` ones.

The protocol (gateway-api-inference-extension, docs/proposals/003-model-server-protocol) asks a
model server for its queued requests, its KV-cache utilization and, for LoRA affinity, its
adapters, and names vLLM's metrics for them; the EPP reads the block size and the number of KV
blocks from vLLM's cache-config info metric. A node exports each under that vLLM name, from the
same engine snapshot as its `duet:*` twin, so the two never disagree:

| protocol metric | type | here | value |
|---|---|---|---|
| TotalQueuedRequests | gauge | `vllm:num_requests_waiting` | `duet:num_requests_waiting` |
| TotalRunningRequests | gauge | `vllm:num_requests_running` | `duet:num_requests_running` |
| KVCacheUtilization | gauge | `vllm:kv_cache_usage_perc` (a) | `duet:kv_cache_usage_perc` (b) |
| cache config | info gauge (1) | `vllm:cache_config_info` (c) | the KV pool's (c) |
| LoRA adapters | gauge | `vllm:lora_requests_info` (d) | the scrape's Unix time (e) |

(a) and the older name `vllm:gpu_cache_usage_perc`; (b) a fraction 0-1, as vLLM's; (c) labels
`block_size, num_gpu_blocks, cache_dtype`: the pool's block size (tokens), blocks and KV dtype;
(d) labels `max_lora, running_lora_adapters, waiting_lora_adapters`; (e) the EPP keeps the newest
series.

`running_lora_adapters` lists the adapters resident on the node (comma-separated, the
protocol's "loaded and ready to serve"); `max_lora` is `--max-loras` (0: no LoRA serving);
`waiting_lora_adapters` is empty: a node loads a requested adapter when the request arrives
(node/lora.py), so no request waits for one. The labels are vLLM's: `model_name` only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: vLLM's name → (the engine stats key, help): the same values as the node's duet:* gauges
_GAUGES = {
    "vllm:num_requests_waiting": (
        "num_requests_waiting",
        "Requests queued (model-server protocol)",
    ),
    "vllm:num_requests_running": ("num_requests_running", "Requests being computed"),
    "vllm:kv_cache_usage_perc": ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)"),
    "vllm:gpu_cache_usage_perc": (
        "kv_cache_usage_perc",
        "Fraction of KV blocks in use (0-1; vLLM's older name)",
    ),
}


class ModelServerCollector(Collector):
    """The protocol's metrics of one node at scrape time. `stats`: the engine's snapshot;
    `block_size`, `num_blocks`, `cache_dtype`: its KV pool (the snapshot's `kv_blocks_total` wins
    when it has it; `cache_dtype` is the pool's, e.g. int8); `adapters`: the LoRA adapters
    resident now."""

    def __init__(
        self,
        stats: Callable[[], dict[str, float]],
        model: str,
        pool: tuple[int, int, str],
        adapters: Callable[[], list[str]],
    ) -> None:
        self._stats, self._model, self._pool, self._adapters = stats, model, pool, adapters

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for name, (key, doc) in _GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(s.get(key, 0)))
            yield g
        block_size, num_blocks, cache_dtype = self._pool
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's configuration (labels; value 1)",
            labels=["model_name", "block_size", "num_gpu_blocks", "cache_dtype"],
        )
        blocks = int(s.get("kv_blocks_total", num_blocks))
        info.add_metric([self._model, str(block_size), str(blocks), cache_dtype], 1.0)
        yield info
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters: most that fit at once, resident, waiting (value: Unix time)",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        slots = str(int(s.get("lora_slots", 0)))
        lora.add_metric([self._model, slots, ",".join(self._adapters()), ""], time.time())
        yield lora
