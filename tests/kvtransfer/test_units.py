"""The parts every backend shares, tested without a second process."""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtransfer import (
    BackendUnavailable,
    BlockRangeError,
    KVTransferMetrics,
    LayoutMismatch,
    PeerError,
    TransferError,
    TransportMetadata,
    decode_metadata,
    encode_metadata,
    make_transport,
    unavailable_reason,
)
from kvtransfer.memory import describe_pool
from kvtransfer.regions import Run, Span, block_descriptors, plan_read, side_runs
from runtime.strict import FallbackRefused, strict_mode
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool, assert_blocks, assert_untouched

SMALL = msgspec.structs.replace(TEST_LAYOUT, num_blocks=16)


def plan(remote: list[int], local: list[int]):  # type: ignore[no-untyped-def]
    return plan_read(remote, local, remote_layout=SMALL, local_layout=SMALL)


def test_runs_pair_blocks_consecutive_on_both_sides() -> None:
    p = plan([3, 4, 5, 9, 10, 2], [1, 2, 3, 7, 9, 10])
    assert p.runs == (Run(3, 1, 3), Run(9, 7, 1), Run(10, 9, 1), Run(2, 10, 1))
    assert p.nbytes == 6 * SMALL.block_bytes
    assert side_runs([1, 2, 3, 7, 9, 10]) == (Span(1, 3), Span(7, 1), Span(9, 2))


def test_a_source_block_may_repeat_but_a_destination_may_not() -> None:
    assert plan([4, 4], [0, 1]).runs == (Run(4, 0, 1), Run(4, 1, 1))
    with pytest.raises(BlockRangeError, match="local block id 1 appears more than once"):
        plan([4, 5], [1, 1])


@pytest.mark.parametrize(
    ("remote", "local", "message"),
    [
        ([16], [0], r"remote block id 16 is out of range \[0, 16\)"),
        ([0], [-1], r"local block id -1 is out of range"),
        ([True], [0], "remote block id True is not an integer"),
        ([0], [1.0], "local block id 1.0 is not an integer"),
        ([0, 1], [0], "remote_block_ids has 2 ids but local_block_ids has 1"),
    ],
)
def test_invalid_ids_are_named(remote: list, local: list, message: str) -> None:
    with pytest.raises(BlockRangeError, match=message):
        plan(remote, local)


def test_numpy_ids_are_accepted() -> None:
    assert plan(np.array([2, 3]), np.array([5, 6])).runs == (Run(2, 5, 2),)  # type: ignore[arg-type]


def test_block_descriptors_are_one_row_per_block() -> None:
    rows = block_descriptors(0x1000, SMALL, device_id=2)
    assert rows.shape == (16, 3)
    assert rows[5].tolist() == [0x1000 + 5 * SMALL.block_bytes, SMALL.block_bytes, 2]


def _metadata(**changes: object) -> TransportMetadata:
    md = TransportMetadata(
        engine_id="P",
        backend="tcp",
        layout=SMALL,
        compat_hash=SMALL.compat_hash,
        device="cpu",
        base_address=4096,
        host="127.0.0.1",
        port=1234,
        agent_metadata=b"\x00\xffblob",
    )
    return msgspec.structs.replace(md, **changes)


def test_metadata_round_trips_as_json() -> None:
    md = _metadata()
    data = encode_metadata(md)
    assert data.startswith(b"{") and b'"compat_hash"' in data
    assert decode_metadata(data) == md
    assert decode_metadata(data.decode()) == md


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not json", "invalid KV transport metadata"),
        (b'{"engine_id": "P"}', "invalid KV transport metadata"),
        (encode_metadata(_metadata(compat_hash="0" * 16)), "is inconsistent: compat_hash"),
        (encode_metadata(_metadata(version=99)), "has version 99"),
    ],
)
def test_bad_metadata_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(TransferError, match=message):
        decode_metadata(data)


def test_metrics_use_the_callers_registry_and_design_names() -> None:
    registry = CollectorRegistry()
    m = KVTransferMetrics(registry)
    m.record(1000, 0.002, blocks=2)
    m.record(500, 0.5)
    m.record_failure("timeout")
    assert (m.transfers, m.bytes, m.blocks, m.failure_count) == (2, 1500, 2, 1)
    assert registry.get_sample_value("duet:kv_transfer_bytes_total") == 1500
    assert registry.get_sample_value("duet:kv_transfer_seconds_count") == 2
    assert registry.get_sample_value("duet:kv_transfer_seconds_bucket", {"le": "0.0025"}) == 1
    assert registry.get_sample_value("duet:kv_transfer_failures_total", {"reason": "timeout"}) == 1
    KVTransferMetrics()  # no registry: plain counters only, nothing global registered


def test_describe_pool_checks_size_contiguity_and_device() -> None:
    t = torch.zeros(SMALL.pool_bytes, dtype=torch.uint8)
    mem = describe_pool(t, SMALL)
    assert (mem.base, mem.nbytes, mem.device) == (t.data_ptr(), SMALL.pool_bytes, "cpu")
    with pytest.raises(TransferError, match="needs"):
        describe_pool(t[:-1], SMALL)
    with pytest.raises(TransferError, match="contiguous"):
        describe_pool(t.view(2, -1).t(), SMALL)
    with pytest.raises(TransferError, match="unsupported pool device 'tpu'"):
        describe_pool(4096, SMALL, "tpu")
    assert describe_pool(4096, SMALL, "cuda").device == "cuda:0"


def test_unknown_backend_and_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown kv transfer backend 'rdma'"):
        make_transport("rdma", engine_id="x")
    with pytest.raises(TypeError, match="does not take option"):
        make_transport("tcp", engine_id="x", progress_thread=True)


def _nixl_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtransfer.nixl_transport as nt

    def missing() -> None:
        raise BackendUnavailable("NIXL is not importable (nixl_cu12: No module named 'x')")

    monkeypatch.setattr(nt, "import_nixl", missing)


def test_nixl_falls_back_to_tcp_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Outside CI (strict mode would refuse the fallback: the next test).
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("DUET_STRICT", raising=False)
    _nixl_missing(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="kvtransfer"):
        t = make_transport("nixl", engine_id="x", timeout=3.0, progress_thread=True)
    assert t.backend == "tcp" and t.timeout == 3.0
    lines = [r for r in caplog.records if r.name.startswith("kvtransfer")]
    assert len(lines) == 1
    assert "falling back to the tcp backend" in lines[0].getMessage()
    assert "No module named 'x'" in lines[0].getMessage()


@pytest.mark.parametrize("env", [{"CI": "true"}, {"DUET_STRICT": "1"}])
def test_strict_mode_refuses_the_nixl_to_tcp_fallback(
    monkeypatch: pytest.MonkeyPatch, env: dict
) -> None:
    monkeypatch.delenv("CI", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _nixl_missing(monkeypatch)
    with pytest.raises(
        FallbackRefused,
        match=r"NIXL unavailable .*No module named 'x'.*refuses to fall back to the tcp",
    ):
        make_transport("nixl", engine_id="x")
    # Asking for tcp is a choice, not a fallback: allowed in strict mode.
    assert make_transport("tcp", engine_id="y").backend == "tcp"


async def test_tcp_refuses_a_cuda_pool_before_touching_it() -> None:
    t = make_transport("tcp", engine_id="x")
    with pytest.raises(BackendUnavailable, match="host memory only"):
        await t.register_pool(0x10000, SMALL, "cuda:0")
    await t.close()


async def test_peer_checks_happen_before_connecting() -> None:
    pool = HostPool(SMALL, 1)
    async with make_transport("tcp", engine_id="D") as t:
        await t.register_pool(pool.base, SMALL)
        # Port 1 is never listened on: each refusal below must come before any connection.
        with pytest.raises(PeerError, match=r"serves its KV pool over 'nixl'.*uses 'tcp'"):
            await t.add_peer(_metadata(backend="nixl", port=1))
        wide = msgspec.structs.replace(SMALL, head_dim=128)
        with pytest.raises(LayoutMismatch, match="head_dim: 64 != 128"):
            await t.add_peer(_metadata(port=1, layout=wide, compat_hash=wide.compat_hash))
        with pytest.raises(PeerError, match="own"):
            await t.add_peer(_metadata(engine_id="D", port=1))
        with pytest.raises(PeerError, match="cannot reach peer 'P'"):
            await t.add_peer(_metadata(port=1))
        assert t.peers == {}


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
async def test_stale_metadata_never_reads_outside_the_owners_pool(backend: str) -> None:
    """A reader whose metadata claims a bigger pool gets an error, not foreign memory: the
    tcp owner re-checks ids, NIXL checks descriptors against the registered region."""
    if (reason := unavailable_reason(backend)) is not None:
        (pytest.fail if strict_mode() else pytest.skip)(reason)  # CI must not pass on a skip
    owner_pool, reader_pool = HostPool(SMALL, 1), HostPool(TEST_LAYOUT, 2)
    async with (
        make_transport(backend, engine_id="P") as owner,
        make_transport(backend, engine_id="D") as reader,
    ):
        await owner.register_pool(owner_pool.base, SMALL)
        await reader.register_pool(reader_pool.base, TEST_LAYOUT)
        md = owner.metadata()
        lying = msgspec.structs.replace(md, layout=TEST_LAYOUT)  # 600 blocks, owner has 16
        with pytest.raises(
            PeerError, match=r"out of range \[0, 16\) of the owner|outside the memory it registered"
        ):
            peer = await reader.add_peer(lying)
            await reader.read(peer, [500], [0])
        assert_untouched(reader_pool, skip=set())
        # The failure dropped the peer; the truthful metadata works.
        peer = await reader.add_peer(md)
        await reader.read(peer, [3], [0])
        assert_blocks(reader_pool, [0], 1, [3])
