"""`bench.pd`: its statistics (per-request parts, then medians; a missing TTFT fails) and a
--quick run end to end on the tiny model with real P, D and colocated nodes over NIXL."""

import json
from pathlib import Path

import pytest

from bench.pd import MissingFigure, check_pulls, disaggregated_row, main, paired_ttft
from bench.pd_client import Result


def _pd(
    rid: str, ttft: float, parts: tuple[float, float, float, float, float], latency: float
) -> Result:
    p_queue, p_prefill, d_queue, transfer, first_decode = parts
    return Result(
        rid,
        token_ids=[1, 2, 3],
        ttft=ttft,
        latency=latency,
        prefill_timing={"queue_s": p_queue, "prefill_s": p_prefill},
        timing={"queue_s": d_queue, "transfer_s": transfer, "first_decode_s": first_decode},
    )


def test_other_is_a_median_of_per_request_differences() -> None:
    rs = [
        _pd("a", 1.0, (0.0, 0.9, 0.0, 0.0, 0.0), 2.0),  # other 0.1
        _pd("b", 2.0, (0.0, 0.1, 0.0, 0.0, 0.0), 3.0),  # other 1.9
        _pd("c", 3.0, (0.0, 2.0, 0.0, 0.0, 0.0), 4.0),  # other 1.0
    ]
    row = disaggregated_row(rs, max_tokens=3)
    assert row["other"]["median"] == pytest.approx(1000.0)  # per request, then the median
    # A median less a median would say 2.0 - 0.9 = 1.1 s, which describes no request.
    assert row["ttft"]["median"] - row["p_prefill"]["median"] == pytest.approx(1100.0)
    assert row["tpot"]["median"] == pytest.approx(500.0)  # (latency - ttft) / 2
    assert row["other"]["p10"] <= row["other"]["median"] <= row["other"]["p90"]


def test_a_missing_ttft_or_part_fails_instead_of_counting_zero() -> None:
    ok = _pd("ok", 1.0, (0.1, 0.2, 0.0, 0.1, 0.1), 2.0)
    silent = _pd("silent", 1.0, (0.1, 0.2, 0.0, 0.1, 0.1), 2.0)
    silent.ttft = None
    with pytest.raises(MissingFigure, match="silent has no time to first token"):
        disaggregated_row([ok, silent], max_tokens=3)
    with pytest.raises(MissingFigure, match="no time to first token"):
        paired_ttft([silent], [ok])
    no_transfer = _pd("nt", 1.0, (0.1, 0.2, 0.0, 0.1, 0.1), 2.0)
    del no_transfer.timing["transfer_s"]
    with pytest.raises(MissingFigure, match="did not report timing 'transfer_s'"):
        disaggregated_row([no_transfer], max_tokens=3)
    short = _pd("short", 1.0, (0.1, 0.2, 0.0, 0.1, 0.1), 2.0)
    with pytest.raises(MissingFigure, match="produced 3 tokens, not 16"):
        disaggregated_row([short], max_tokens=16)


def test_ttft_ratio_pairs_the_same_prompt() -> None:
    rs = [_pd(str(i), t, (0, 0, 0, 0, 0), 2 * t) for i, t in enumerate([1.0, 4.0, 9.0])]
    cs = [_pd(str(i), t, (0, 0, 0, 0, 0), 2 * t) for i, t in enumerate([0.5, 4.0, 3.0])]
    paired = paired_ttft(rs, cs)
    assert paired["ratio_disagg_over_colocated"]["median"] == pytest.approx(2.0)  # ratios 2, 1, 3
    assert paired["diff_ms_disagg_minus_colocated"]["median"] == pytest.approx(500.0)  # 0.5, 0, 6


def test_a_run_on_the_wrong_transport_or_a_recompute_fails() -> None:
    good = "INFO duet [-] duet.node: KV transport: nixl\n"
    assert "KV transport: nixl" in check_pulls(good, "nixl", {"prefill": good, "decode": good})
    tcp = (
        "WARNING ...; falling back to the tcp backend\nINFO duet [-] duet.node: KV transport: tcp\n"
    )
    with pytest.raises(RuntimeError, match="prefill node runs transport"):
        check_pulls(good, "nixl", {"prefill": tcp, "decode": good})
    recomputed = (
        good
        + "WARNING duet [x] duet.decode: KV pull failed (TransferTimeout: ...); policy recompute\n"
    )
    with pytest.raises(RuntimeError, match="recomputed instead of pulling"):
        check_pulls(recomputed, "nixl", {"prefill": good, "decode": recomputed})


def test_bench_pd_quick_json(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_llama), "--quick", "--reps", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["quick"] and r["transport"] == "nixl" and "KV transport: nixl" in r["transport_log"]
    assert set(r["lengths"]) == {"32", "64"}
    for row in r["lengths"].values():
        d, c = row["disaggregated"], row["colocated"]
        assert set(d) == {
            "ttft",
            "p_queue",
            "p_prefill",
            "transfer",
            "d_first_decode",
            "other",
            "tpot",
        }
        assert set(c) == {"ttft", "queue", "prefill", "tpot"}
        for fig in [*d.values(), *c.values()]:
            assert fig["p10"] <= fig["median"] <= fig["p90"]
        assert d["ttft"]["p10"] > 0 and c["ttft"]["p10"] > 0 and d["transfer"]["p10"] > 0
        assert row["ttft_paired"]["ratio_disagg_over_colocated"]["median"] > 0
