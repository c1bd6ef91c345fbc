"""Whole simulations: every request finishes, the KV moved is the prompt's, prefixes hit the
real prefix cache, more nodes under the same load mean lower latency, admission sheds."""

from __future__ import annotations

import pytest

from gateway.config import TierConfig
from sim.cluster import Layout, NodeGroup
from sim.run import simulate
from sim.stats import SLO
from sim.workload import Synthetic, WorkItem, synthetic
from tests.sim.helpers import toy_profile

PD = (NodeGroup("prefill", 1), NodeGroup("decode", 1))


def test_disaggregated_moves_each_prompts_kv_once() -> None:
    items = [
        WorkItem(t=i * 2.0, prompt=list(range(2, 2 + 320 + i)), max_tokens=4) for i in range(5)
    ]
    # distinct first tokens: no prefix hits on D
    items = [
        WorkItem(t=x.t, prompt=[1000 + i, *x.prompt], max_tokens=4) for i, x in enumerate(items)
    ]
    s, c = simulate(toy_profile(), Layout(PD), items)
    assert s.completed == 5 and s.paths == {"disaggregated": 5}
    # D reserves every block of the prompt; the last (partial) block moves too
    expected = sum(-(-len(x.prompt) // 16) * 16 * 1000 for x in items)
    assert c.transfer_bytes == expected and c.transfers == 5


def test_shared_prefixes_hit_the_prefix_cache() -> None:
    base = dict(rate=4, duration_s=30, input_len="64", output_len="8", seed=3)
    shared, _ = simulate(
        toy_profile(),
        Layout((NodeGroup("both", 1),)),
        synthetic(Synthetic(**base, prefix_groups=2, prefix_len=512)),
    )
    assert shared.cached_token_fraction > 0.7
    assert shared.completed == shared.requests


def test_more_nodes_lower_latency_under_the_same_load() -> None:
    w = Synthetic(rate=12, duration_s=60, input_len="300", output_len="32", seed=1)
    one, _ = simulate(
        toy_profile(), Layout((NodeGroup("both", 1),)), synthetic(w), slo=SLO(ttft_p90_ms=500)
    )
    two, _ = simulate(
        toy_profile(), Layout((NodeGroup("both", 2),)), synthetic(w), slo=SLO(ttft_p90_ms=500)
    )
    assert one.completed == two.completed == one.requests
    assert two.latency_ms["p90_ttft"] < one.latency_ms["p90_ttft"]
    assert two.latency_ms["p50_tpot"] < one.latency_ms["p50_tpot"]
    assert two.utilisation["both"] < one.utilisation["both"]


def test_admission_sheds_past_its_queue() -> None:
    tiers = TierConfig(max_inflight=2, interactive_queue=3, interactive_max_wait_s=30)
    items = [WorkItem(t=0.0, prompt=[5 + i] * 40, max_tokens=50) for i in range(10)]
    s, _ = simulate(
        toy_profile(), Layout((NodeGroup("both", 1),), tiers=tiers), items, slo=SLO(max_failed=0.0)
    )
    assert s.completed == 5 and s.failures == {"shed": 5}
    assert s.meets_slo is False


def test_cost_per_million_tokens() -> None:
    items = [WorkItem(t=float(i), prompt=[7 + i] * 100, max_tokens=100) for i in range(10)]
    s, _ = simulate(toy_profile(), Layout((NodeGroup("both", 2),)), items, node_price_per_hour=3.6)
    assert s.cost_per_hour == 7.2
    assert s.usd_per_m_output is not None
    assert abs(s.usd_per_m_output - 7.2 * s.window_s / 3600 / 1000 * 1e6) < 1e-6


def test_a_nodes_streaming_cpu_lengthens_its_steps_not_the_prefill_nodes() -> None:
    import msgspec

    base = msgspec.structs.replace(toy_profile(), contention=2.0)
    ov = msgspec.structs.replace(base.overheads, node_token_cpu_s=0.005)
    streaming = msgspec.structs.replace(base, overheads=ov)
    item = [WorkItem(t=0.0, prompt=list(range(3, 403)), max_tokens=20)]
    plain, _ = simulate(base, Layout((NodeGroup("both", 1),)), item)
    slow, _ = simulate(streaming, Layout((NodeGroup("both", 1),)), item)
    # one sequence: every step samples one token, which costs 5 ms of CPU × contention 2 beside it
    assert slow.latency_ms["p50_tpot"] - plain.latency_ms["p50_tpot"] == pytest.approx(
        10.0, abs=0.01
    )
    _, c = simulate(streaming, Layout(PD), item)
    _, c0 = simulate(base, Layout(PD), item)
    busy = {
        role: (st.busy_s, st0.busy_s)
        for (role, st), (_, st0) in zip(c.nodes.values(), c0.nodes.values(), strict=True)
    }
    assert busy["prefill"][0] == busy["prefill"][1] > 0  # P answers once: no per-token cost
    assert busy["decode"][0] == pytest.approx(busy["decode"][1] + 20 * 0.010)
