"""The load frame's latency histograms on the wire: a frame from a node before them
still decodes (no histogram: the planner weighs that node's own P90), a frame with them decodes
in a reader from before them (msgspec skips the fields it does not know), so nodes and
coordinators upgrade in either order; and the histogram's own checks and buckets."""

from __future__ import annotations

import math

import msgspec
import pytest

from protocol.kv_events import EventBatch, FrameDecoder, LoadFrame, encode_frame
from protocol.latency_hist import (
    GROWTH,
    MAX_INDEX,
    MIN_INDEX,
    RELATIVE_ERROR,
    LatencyHistogram,
    MergedLatency,
    bucket,
    bucket_value,
    histogram_of,
)


class OldLoadFrame(msgspec.Struct, frozen=True, kw_only=True, tag="LoadFrame"):
    """LoadFrame as nodes and coordinators had it before the histograms (commit 0f86272)."""

    seq: int
    ts: float
    num_requests_waiting: int
    num_requests_running: int
    kv_cache_usage_perc: float
    queued_prefill_tokens: int
    kv_blocks_free: int
    kv_blocks_total: int
    taken: list[str] | None = None
    ttft_p90_s: float = 0.0
    ttft_samples: int = 0
    itl_p90_s: float = 0.0
    itl_samples: int = 0
    latency_window_s: float = 0.0


BASE = dict(
    seq=3,
    ts=1.5,
    num_requests_waiting=1,
    num_requests_running=2,
    kv_cache_usage_perc=0.25,
    queued_prefill_tokens=64,
    kv_blocks_free=90,
    kv_blocks_total=100,
    taken=["r1"],
    ttft_p90_s=0.4,
    ttft_samples=3,
    itl_p90_s=0.02,
    itl_samples=5,
    latency_window_s=30.0,
)
HIST = histogram_of(bucket(x) for x in (0.1, 0.2, 0.4))


def test_an_older_nodes_frame_decodes_without_histograms() -> None:
    wire = encode_frame(msgspec.msgpack.Encoder(), OldLoadFrame(**BASE))  # type: ignore[arg-type]
    [frame] = FrameDecoder().feed(wire)
    assert isinstance(frame, LoadFrame)
    assert (frame.ttft_p90_s, frame.ttft_samples, frame.ttft_hist, frame.itl_hist) == (
        0.4,
        3,
        None,
        None,
    )


def test_a_new_frame_decodes_in_an_older_reader() -> None:
    new = LoadFrame(**BASE, ttft_hist=HIST, itl_hist=LatencyHistogram())  # type: ignore[arg-type]
    wire = encode_frame(msgspec.msgpack.Encoder(), new)
    old_reader = msgspec.msgpack.Decoder(EventBatch | OldLoadFrame)  # the old FrameDecoder's union
    frame = old_reader.decode(wire[4:])
    assert frame == OldLoadFrame(**BASE)  # type: ignore[arg-type]
    # and in a new one, the histograms as sent
    [back] = FrameDecoder().feed(wire)
    assert isinstance(back, LoadFrame) and (back.ttft_hist, back.itl_hist) == (
        HIST,
        LatencyHistogram(),
    )


def test_a_histogram_with_negative_or_too_many_counts_is_refused() -> None:
    enc = msgspec.msgpack.Encoder()
    for bad in (
        LatencyHistogram(first=0, counts=[3, -1]),
        LatencyHistogram(first=0, counts=[1] * 1000),
    ):
        wire = encode_frame(enc, LoadFrame(**BASE, ttft_hist=bad))  # type: ignore[arg-type]
        with pytest.raises(msgspec.ValidationError):
            FrameDecoder().feed(wire)


def test_a_histogram_of_an_unknown_scheme_decodes_and_is_not_merged() -> None:
    wire = encode_frame(
        msgspec.msgpack.Encoder(),
        LoadFrame(**BASE, ttft_hist=LatencyHistogram(scheme=9, counts=[3])),
    )  # type: ignore[arg-type]
    [frame] = FrameDecoder().feed(wire)
    assert isinstance(frame, LoadFrame) and frame.ttft_hist is not None
    m = MergedLatency()
    assert not m.add(frame.ttft_hist) and m.total == 0


def test_buckets_and_their_resolution() -> None:
    assert math.isclose(RELATIVE_ERROR, math.sqrt(1.1) - 1) and RELATIVE_ERROR < 0.05
    for x in (1e-5, 3.3e-4, 0.05, 0.999, 1.0, 1.1, 2.0, 37.0, 900.0):
        i = bucket(x)
        assert GROWTH ** (i - 1) < x * (1 + 1e-12) and x <= GROWTH**i * (1 + 1e-12)
        assert abs(bucket_value(i) - x) <= RELATIVE_ERROR * x
    # outside the range: the end buckets, never an error
    assert [bucket(x) for x in (0.0, -1.0, 1e-9)] == [MIN_INDEX] * 3
    assert [bucket(x) for x in (1e6, math.inf, math.nan)] == [MAX_INDEX] * 3


def test_merged_quantile_is_the_nearest_rank_bucket() -> None:
    m = MergedLatency()
    assert m.quantile(0.9) == 0.0
    m.add(histogram_of([bucket(0.05)] * 9))
    m.add(histogram_of([bucket(2.0)]))
    assert m.total == 10 and m.quantile(0.9) == bucket_value(bucket(0.05))  # the 9th of 10
    m.add(histogram_of([bucket(2.0)]))
    assert m.quantile(0.9) == bucket_value(bucket(2.0))  # the 10th of 11
