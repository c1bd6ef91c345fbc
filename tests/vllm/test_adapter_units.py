"""The vLLM adapter's translations, on vLLM's own classes (no engine started): duet's sampling
parameters → vLLM's, and vLLM's per-step stats → duet's metric keys. Needs vLLM (skipped
without it; .ci/run runs it in its vLLM stage)."""

from __future__ import annotations

from protocol.kv_params import KVTransferParams
from protocol.sampling import SamplingParams


def test_sampling_params_map_onto_vllms(need_vllm: None) -> None:
    from vllm.sampling_params import RequestOutputKind

    from node.engines.vllm_sampling import vllm_sampling

    p = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_k=0,
        top_p=0.9,
        seed=3,
        stop=["\n\n"],
        stop_token_ids=[2],
        ignore_eos=True,
        min_tokens=1,
        skip_special_tokens=False,
    )
    kv = KVTransferParams(do_remote_decode=True)
    v = vllm_sampling(p, kv)
    assert (v.max_tokens, v.temperature, v.top_p, v.seed, v.stop, v.ignore_eos, v.min_tokens) == (
        7,
        0.5,
        0.9,
        3,
        ["\n\n"],
        True,
        1,
    )
    assert 2 in v.stop_token_ids and v.skip_special_tokens is False
    assert v.top_k in (0, -1)  # disabled in both spellings vLLM accepts
    assert v.output_kind == RequestOutputKind.DELTA
    assert v.extra_args == {"kv_transfer_params": {"do_remote_decode": True}}
    assert vllm_sampling(SamplingParams(top_k=5), None).top_k == 5
    assert not vllm_sampling(SamplingParams(), None).extra_args


def test_penalties_and_guides_map_onto_vllms(need_vllm: None) -> None:
    """The penalty fields under vLLM's names, and each guide kind as vLLM's
    StructuredOutputsParams with exactly one constraint set (vLLM refuses zero or several)."""
    import json

    from node.engines.vllm_sampling import vllm_sampling
    from protocol.structured import Guide, GuideKind

    p = SamplingParams(
        frequency_penalty=0.5,
        presence_penalty=-1.0,
        repetition_penalty=1.2,
        min_p=0.1,
        logit_bias={7: -100.0, 9: 2.5},
    )
    v = vllm_sampling(p, None)
    assert (v.frequency_penalty, v.presence_penalty, v.repetition_penalty, v.min_p) == (
        0.5,
        -1.0,
        1.2,
        0.1,
    )
    assert v.logit_bias == {7: -100.0, 9: 2.5}
    plain = vllm_sampling(SamplingParams(), None)
    assert not plain.logit_bias and plain.structured_outputs is None
    assert (
        plain.frequency_penalty,
        plain.presence_penalty,
        plain.repetition_penalty,
        plain.min_p,
    ) == (0, 0, 1, 0)
    schema = '{"type":"object","properties":{"a":{"type":"integer"}}}'
    want = {
        GuideKind.JSON_SCHEMA: ("json", schema),
        GuideKind.JSON_OBJECT: ("json_object", True),
        GuideKind.REGEX: ("regex", "[0-9]+"),
        GuideKind.CHOICE: ("choice", ["x", "y z"]),
    }
    for kind, (field, value) in want.items():
        spec = {GuideKind.JSON_OBJECT: "", GuideKind.CHOICE: json.dumps(["x", "y z"])}.get(
            kind, value
        )
        so = vllm_sampling(
            SamplingParams(guide=Guide(kind=kind, spec=spec)), None
        ).structured_outputs
        assert getattr(so, field) == value, kind
        others = {"json", "json_object", "regex", "choice", "grammar", "structural_tag"} - {field}
        assert all(getattr(so, f) in (None, False) for f in others), (kind, so)
    # a bounded number reaches vLLM with its fraction cut, as on the native engine
    # (text/json_bounds.py)
    price = '{"type":"number","minimum":0,"maximum":100}'
    so = vllm_sampling(
        SamplingParams(guide=Guide(kind=GuideKind.JSON_SCHEMA, spec=price)), None
    ).structured_outputs
    assert json.loads(so.json) == {
        "type": "number",
        "minimum": 0,
        "maximum": 100,
        "multipleOf": 1e-10,
    }


def test_stats_keep_gauges_and_sum_counters(need_vllm: None) -> None:
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

    from node.engines.vllm_stats import VllmStats

    s = VllmStats()
    s.set_capacity(100)
    for _ in range(2):
        it = IterationStats()
        it.num_generation_tokens = 3
        it.num_preempted_reqs = 1
        s.record(
            SchedulerStats(
                num_running_reqs=2,
                num_waiting_reqs=1,
                kv_cache_usage=0.25,
                prefix_cache_stats=PrefixCacheStats(requests=1, queries=32, hits=16),
            ),
            it,
        )
    v = s.snapshot()
    assert (v["num_requests_running"], v["num_requests_waiting"], v["kv_cache_usage_perc"]) == (
        2,
        1,
        0.25,
    )
    assert v["kv_blocks_total"] == 100 and v["kv_blocks_free"] == 75
    assert (v["prefix_cache_queries"], v["prefix_cache_hits"]) == (64, 32)
    assert (v["generation_tokens"], v["num_preemptions"]) == (6, 2)
