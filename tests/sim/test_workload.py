"""Arrival sources: distributions, a bench-serve result file, a Mooncake trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim import workload as wl


def test_synthetic_is_seeded_and_shares_prefixes() -> None:
    w = wl.Synthetic(
        rate=10,
        duration_s=20,
        input_len="50",
        output_len="uniform:5,9",
        prefix_groups=3,
        prefix_len=32,
    )
    a, b = list(wl.synthetic(w)), list(wl.synthetic(w))
    assert [x.prompt for x in a] == [x.prompt for x in b]
    assert 150 < len(a) < 260 and all(x.t <= 20 for x in a)
    assert all(len(x.prompt) == 82 and 5 <= x.max_tokens <= 9 for x in a)
    assert a[0].prompt[:32] == a[3].prompt[:32] != a[1].prompt[:32]


def test_result_file_replays_the_runs_schedule(tmp_path: Path) -> None:
    f = tmp_path / "r.json"
    f.write_text(
        json.dumps(
            {
                "config": {"output_len": "16", "prefix_groups": 0, "prefix_len": 0},
                "scheduled_times": [0.5, 0.0, 1.0],
                "input_lens": [10, 20, 30],
                "output_lens": [16, 16, 0],
                "tiers": [None, "batch", None],
            }
        )
    )
    items = list(wl.from_result_file(f))
    assert [(x.t, len(x.prompt), x.max_tokens, x.tier) for x in items] == [
        (0.0, 20, 16, "batch"),
        (0.5, 10, 16, "interactive"),
        (1.0, 30, 16, "interactive"),
    ]
    (tmp_path / "sweep.json").write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match="one run"):
        list(wl.from_result_file(tmp_path / "sweep.json"))


def test_mooncake_trace_reproduces_shared_blocks(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 3000, "input_length": 700, "output_length": 6, "hash_ids": [7, 9]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    a, b = wl.mooncake(f, block_size=512)
    assert (a.t, b.t) == (0.0, 2.0)
    assert len(a.prompt) == 1000 and len(b.prompt) == 700
    assert a.prompt[:512] == b.prompt[:512] and a.prompt[512:700] != b.prompt[512:700]


def test_a_result_file_replays_the_prefix_groups_the_run_drew(tmp_path: Path) -> None:
    """`duet bench serve` draws each prompt's group at random, and which prompt comes first in its
    group (a cold prefill) decides routing: the replay takes the recorded groups, not a round
    robin (sim.validate's prefix case: requests 0, 1, 3, 6 were the groups' firsts for real; round
    robin made them 0, 1, 2, 3)."""
    f = tmp_path / "r.json"
    groups = [2, 0, 2, 1, 0]
    f.write_text(
        json.dumps(
            {
                "config": {"output_len": "4", "prefix_groups": 3, "prefix_len": 32},
                "scheduled_times": [0.0, 0.1, 0.2, 0.3, 0.4],
                "input_lens": [40] * 5,
                "output_lens": [4] * 5,
                "groups": groups,
            }
        )
    )
    items = list(wl.from_result_file(f))
    assert all(len(x.prompt) == 40 for x in items)
    prefix = [tuple(x.prompt[:32]) for x in items]
    for i in range(5):
        for j in range(5):
            assert (prefix[i] == prefix[j]) == (groups[i] == groups[j]), (i, j)
    # an older result (no groups): round robin over the configured groups, as before
    f.write_text(
        json.dumps(
            {
                "config": {"output_len": "4", "prefix_groups": 2, "prefix_len": 32},
                "scheduled_times": [0.0, 0.1, 0.2],
                "input_lens": [40] * 3,
                "output_lens": [4] * 3,
            }
        )
    )
    a, b, c = wl.from_result_file(f)
    assert a.prompt[:32] == c.prompt[:32] != b.prompt[:32]
    f.write_text(
        json.dumps(
            {
                "config": {"output_len": "4", "prefix_groups": 2, "prefix_len": 32},
                "scheduled_times": [0.0],
                "input_lens": [40],
                "output_lens": [4],
                "groups": [5],
            }
        )
    )
    with pytest.raises(ValueError, match="prefix group 5"):
        list(wl.from_result_file(f))
    # groups recorded, but the run configured none: a malformed file, refused the same way
    f.write_text(
        json.dumps(
            {
                "config": {"output_len": "4", "prefix_groups": 0, "prefix_len": 0},
                "scheduled_times": [0.0],
                "input_lens": [40],
                "output_lens": [4],
                "groups": [0],
            }
        )
    )
    with pytest.raises(ValueError, match="prefix group 0 is not one of the 0 groups"):
        list(wl.from_result_file(f))


def test_a_result_file_replays_the_shared_prefix_as_the_server_tokenized_it(tmp_path: Path) -> None:
    """Text prompts do not round-trip random ids: a 32-id prefix may be 35 tokens once encoded
    again. The replay shares exactly the recorded tokens (the prefix cache hits that many), not the
    configured prefix length; the prompt keeps its recorded length."""
    f = tmp_path / "r.json"
    f.write_text(
        json.dumps(
            {
                "config": {"output_len": "4", "prefix_groups": 2, "prefix_len": 32},
                "scheduled_times": [0.0, 0.1, 0.2, 0.3],
                "input_lens": [40, 41, 40, 39],
                "output_lens": [4] * 4,
                "groups": [0, 0, 1, 0],
                "prefix_tokens": [35, 34, 31, 35],
            }
        )
    )
    a, b, c, d = wl.from_result_file(f)
    assert [len(x.prompt) for x in (a, b, c, d)] == [40, 41, 40, 39]

    def common(x: list[int], y: list[int]) -> int:
        return next(
            (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
        )

    assert common(a.prompt, d.prompt) == 35 and common(a.prompt, b.prompt) == 34
    assert common(a.prompt, c.prompt) == 0  # another group
    # an older result (no prefix_tokens): the configured length, as before
    f.write_text(
        json.dumps(
            {
                "config": {"output_len": "4", "prefix_groups": 1, "prefix_len": 32},
                "scheduled_times": [0.0, 0.1],
                "input_lens": [40, 40],
                "output_lens": [4] * 2,
                "groups": [0, 0],
            }
        )
    )
    a, b = wl.from_result_file(f)
    assert common(a.prompt, b.prompt) == 32
    for bad in (-1, 3.5, "40"):
        f.write_text(
            json.dumps(
                {
                    "config": {"output_len": "4", "prefix_groups": 1, "prefix_len": 32},
                    "scheduled_times": [0.0],
                    "input_lens": [40],
                    "output_lens": [4],
                    "groups": [0],
                    "prefix_tokens": [bad],
                }
            )
        )
        with pytest.raises(ValueError, match="prefix_tokens must be whole numbers"):
            list(wl.from_result_file(f))
