"""Prometheus metrics of a node, named after vLLM/Dynamo (DESIGN §4) so dashboards fit.

Latency histograms are observed by the request handlers; engine gauges and counters are read
from the engine's last stats snapshot at scrape time (a custom collector: no second source of
truth). One registry per app: no global state, several nodes can live in one test process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node.latency_window import RecentLatency
from text.guide_compile import Verdict

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)

_GAUGES = {
    "duet:num_requests_running": ("num_requests_running", "Requests being computed"),
    "duet:num_requests_waiting": (
        "num_requests_waiting",
        "Requests queued (incl. waiting for remote KV)",
    ),
    "duet:num_requests_held": (
        "num_requests_held",
        "Finished prefills holding blocks for a transfer",
    ),
    "duet:kv_cache_usage_perc": ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)"),
    "duet:num_waiting_tokens": ("num_waiting_tokens", "Prompt tokens of the requests waiting"),
    "duet:engine_queue_full": (
        "queue_full",
        "1 while the engine's waiting queue refuses new requests",
    ),
    "duet:kv_blocks_quarantined": (
        "kv_blocks_quarantined",
        "KV blocks set aside until a failed transfer is known stopped",
    ),
    "duet:kv_blocks_retained": (
        "kv_blocks_retained",
        "KV block hashes a client asked to keep cached (cache_control), in any tier or pending",
    ),
    "duet:engine_sleeping": ("sleeping", "1 while the engine sleeps (weights and KV released)"),
    "duet:lora_adapters_loaded": ("lora_adapters_loaded", "LoRA adapters resident"),
    "duet:lora_slots": ("lora_slots", "LoRA adapter slots (--max-loras)"),
    "duet:engine_last_wake_seconds": (
        "last_wake_seconds",
        "Seconds the engine's last wake from sleep took (weights rebuilt)",
    ),
    "duet:kv_host_tier_blocks": ("kv_host_blocks", "KV blocks in the host spill tier"),
    "duet:kv_host_tier_bytes": ("kv_host_bytes", "Bytes of KV in the host spill tier"),
    "duet:kv_disk_tier_blocks": ("kv_disk_blocks", "KV blocks in the disk spill tier"),
    "duet:kv_disk_tier_bytes": ("kv_disk_bytes", "Bytes of KV in the disk spill tier"),
}
_COUNTERS = {
    "duet:prefix_cache_queries": (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
    ),
    "duet:prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache"),
    "duet:prompt_tokens": ("prompt_tokens_computed", "Prompt tokens computed"),
    "duet:kv_reuse_prompt_tokens": (
        "kv_reuse_queries",
        "Prompt tokens of the requests whose prompt this node computed (duet:kv_reused_tokens' "
        "denominator)",
    ),
    "duet:generation_tokens": ("generation_tokens", "Tokens generated"),
    "duet:num_preemptions": ("num_preemptions", "Requests preempted (recompute)"),
    "duet:engine_wakes": ("wakes", "Times the engine woke from sleep"),
    "duet:num_requests_failed": (
        "num_requests_failed",
        "Requests the engine failed alone (finish_reason error)",
    ),
    # the engine thread's own accounts (engine/async_engine.py StepTiming): step time inside a
    # running node, and the time the node's other work put between two steps
    "duet:engine_steps": ("engine_steps", "Engine steps run"),
    "duet:engine_step_seconds": ("engine_step_seconds", "Wall seconds inside engine steps"),
    "duet:engine_step_cpu_seconds": (
        "engine_step_cpu_seconds",
        "CPU seconds of the engine thread inside steps",
    ),
    "duet:engine_step_gap_seconds": (
        "engine_step_gap_seconds",
        "Wall seconds between a step that left work and the next step",
    ),
    "duet:engine_step_gaps": ("engine_step_gaps", "Gaps counted in duet:engine_step_gap_seconds"),
    "duet:engine_decode_steps": (
        "engine_decode_steps",
        "Engine steps that computed no prompt token",
    ),
    "duet:engine_decode_step_seconds": (
        "engine_decode_step_seconds",
        "Wall seconds inside those steps",
    ),
    "duet:engine_decode_step_cpu_seconds": (
        "engine_decode_step_cpu_seconds",
        "CPU seconds of the engine thread inside those steps",
    ),
    # speculative decoding, vLLM's spec_decode_* counters (0 while speculation is off): the
    # acceptance rate is accepted / draft tokens, the mean acceptance length 1 + accepted / drafts
    "duet:spec_decode_num_drafts": ("spec_decode_num_drafts", "Speculative drafts verified"),
    "duet:spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed"),
    "duet:spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens",
        "Draft tokens accepted",
    ),
}
#: the engine stats key prefix of the accepted tokens per draft position (`...per_pos.<position>`)
_PER_POS = "spec_decode_num_accepted_tokens_per_pos."
#: counters the engine keeps per source of KV (`<prefix><source>`: pool, transfer, peer, host,
#: disk), exported with a `source` label
_BY_SOURCE = {
    "duet:kv_digest_checks": (
        "kv_digest_checks_",
        "KV blocks whose content digest was checked before use, by where their KV came from",
    ),
    "duet:kv_digest_mismatches": (
        "kv_digest_mismatches_",
        "KV blocks that failed their digest (dropped and recomputed), by where their KV came from",
    ),
    "duet:kv_reused_tokens": (
        "kv_reused_tokens_",
        "Prompt tokens this node did not compute because their KV was reused, by where it was: "
        "its pool, its host or disk tier, a peer",
    ),
}
#: the spill tiers' block moves (`kv_tier_<move>_<medium>`: spilled, demoted, loaded, dropped)
_MOVES = "kv_tier_"


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, float]], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        names, values = list(self._labels), list(self._labels.values())
        for name, (key, doc) in _GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(s.get(key, 0)))
            yield g
        for name, (key, doc) in _COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(s.get(key, 0)))
            yield c
        pos = CounterMetricFamily(
            "duet:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft",
            labels=[*names, "position"],
        )
        for key in sorted(
            (k for k in s if k.startswith(_PER_POS)), key=lambda k: int(k[len(_PER_POS) :])
        ):
            pos.add_metric([*values, key[len(_PER_POS) :]], float(s[key]))
        yield pos
        moves = CounterMetricFamily(
            "duet:kv_tier_moves",
            "KV blocks moved by the spill tiers, by move (spilled, demoted, loaded, dropped) "
            "and the tier it concerns",
            labels=[*names, "move", "medium"],
        )
        for key in sorted(k for k in s if k.startswith(_MOVES)):
            move, _, medium = key[len(_MOVES) :].partition("_")
            moves.add_metric([*values, move, medium], float(s[key]))
        yield moves
        for name, (prefix, doc) in _BY_SOURCE.items():
            c = CounterMetricFamily(name, doc, labels=[*names, "source"])
            for key in sorted(k for k in s if k.startswith(prefix)):
                c.add_metric([*values, key[len(prefix) :]], float(s[key]))
            yield c


class NodeMetrics:
    def __init__(
        self,
        stats: Callable[[], dict[str, float]],
        model: str,
        role: str,
        model_server: Collector | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        if model_server is not None:  # the endpoint pickers' vLLM names (model_server_metrics.py)
            self.registry.register(model_server)
        self.labels = {"model_name": model, "role": role}
        names = list(self.labels)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.ttft = hist("duet:time_to_first_token_seconds", "Time to first token").labels(
            **self.labels
        )
        self.itl = hist("duet:inter_token_latency_seconds", "Time between tokens").labels(
            **self.labels
        )
        self.e2e = hist("duet:e2e_request_latency_seconds", "Request latency").labels(**self.labels)
        # the same observations over the last 30 s, for the load frames the planner reads
        self.recent_ttft = RecentLatency()
        self.recent_itl = RecentLatency()
        self.registry.register(_EngineCollector(stats, self.labels))
        self._rejected = Counter(
            "duet:num_requests_rejected",
            "Requests refused before running, by reason",
            [*names, "reason"],
            registry=self.registry,
        )
        self._peer_pulls = Counter(
            "duet:kv_peer_pulls",
            "Pulls of a prompt's prefix from a peer node (the route's kv_source), by outcome",
            [*names, "outcome"],
            registry=self.registry,
        )
        self._peer_blocks = Counter(
            "duet:kv_peer_pulled_blocks",
            "KV blocks pulled from peers and used",
            names,
            registry=self.registry,
        )
        # the grammar checks of request guides (text/guide_compile.py), as the gateway counts
        # them: one compile per distinct guide (a resent one is answered from the cache)
        self._guide_compiles = Counter(
            "duet:guide_compiles",
            "Grammar compiles of request guides, by verdict",
            [*names, "verdict"],
            registry=self.registry,
        )
        self._lora_loads = Counter(
            "duet:lora_loads", "LoRA adapters loaded at run time", names, registry=self.registry
        ).labels(**self.labels)
        self._lora_evictions = Counter(
            "duet:lora_evictions",
            "LoRA adapters unloaded to make room for another (least recently used)",
            names,
            registry=self.registry,
        ).labels(**self.labels)
        self._guide_compiling = Gauge(
            "duet:guide_compiles_running",
            "Grammar compiles running on their threads",
            names,
            registry=self.registry,
        ).labels(**self.labels)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.recent_ttft.add(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.recent_itl.add(seconds)

    def lora_loaded(self, evicted: list[str]) -> None:
        self._lora_loads.inc()
        self._lora_evictions.inc(len(evicted))

    def peer_pull(self, outcome: str, blocks: int) -> None:
        """Count a pull of a prefix from a peer (ok, mismatch, no_share, bad_share,
        peer_refused, gap, timeout, read_failed, aborted) and the blocks it brought."""
        self._peer_pulls.labels(**self.labels, outcome=outcome).inc()
        if blocks:
            self._peer_blocks.labels(**self.labels).inc(blocks)

    def rejected(self, reason: str) -> None:
        """Count a refused request (queue_full, draining, engine_dead, body_too_large, ...)."""
        self._rejected.labels(**self.labels, reason=reason).inc()

    def guide_compiled(self, verdict: Verdict) -> None:
        self._guide_compiles.labels(**self.labels, verdict=verdict.value).inc()

    def guides_compiling(self, n: int) -> None:
        self._guide_compiling.set(n)
