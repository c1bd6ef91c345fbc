"""Two real processes per backend: an owner (tests/kvtransfer/peer.py) and this test as reader."""

from __future__ import annotations

import asyncio
import base64
import random
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import aiohttp
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtransfer import (
    BACKENDS,
    BlockRangeError,
    KVTransferMetrics,
    LayoutMismatch,
    Peer,
    PeerError,
    TransferError,
    TransferTimeout,
    Transport,
    make_transport,
    unavailable_reason,
)
from runtime.strict import strict_mode
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool, assert_blocks, assert_untouched
from tests.kvtransfer.procs import PeerProcess

pytestmark = pytest.mark.timeout(120)

D_SEED = 2
P_SEED = 1
# Slack over a transfer timeout for scheduling on a loaded 2-core CI machine.
SLACK = 1.5


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    reason = unavailable_reason(request.param)
    if reason is not None:  # in CI (strict mode) a backend that cannot run is a failure, not a skip
        (pytest.fail if strict_mode() else pytest.skip)(
            f"{request.param} backend not usable here: {reason}"
        )
    return request.param


@pytest.fixture(scope="module")
def owner(backend: str) -> Iterator[PeerProcess]:
    """One long-lived owner per backend for the tests that leave it healthy."""
    p = PeerProcess(backend, f"P-{backend}", P_SEED)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def spawn(backend: str) -> Iterator[Callable[..., PeerProcess]]:
    """Start extra owners for one test; all are stopped at its end, pass or fail."""
    started: list[PeerProcess] = []

    def start(engine_id: str, seed: int, layout: dict | None = None) -> PeerProcess:
        p = PeerProcess(backend, engine_id, seed, layout)
        started.append(p)
        return p

    try:
        yield start
    finally:
        for p in started:
            p.stop()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def pool() -> HostPool:
    return HostPool(TEST_LAYOUT, D_SEED)


@pytest.fixture
async def reader(
    backend: str, pool: HostPool, registry: CollectorRegistry
) -> AsyncIterator[Transport]:
    t = make_transport(
        backend, engine_id=f"D-{uuid.uuid4().hex[:8]}", metrics=KVTransferMetrics(registry)
    )
    # Registered as a tensor (the engine's way); the owners register a base address.
    await t.register_pool(torch.from_numpy(pool.bytes), TEST_LAYOUT)
    try:
        yield t
    finally:
        await t.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def fetch_metadata(http: aiohttp.ClientSession, p: PeerProcess) -> bytes:
    async with http.get(p.url("/kv/metadata")) as r:
        assert r.status == 200
        return await r.read()


async def connect(reader: Transport, http: aiohttp.ClientSession, p: PeerProcess) -> Peer:
    return await reader.add_peer(await fetch_metadata(http, p))


async def test_read_three_blocks_byte_identical(
    reader: Transport,
    pool: HostPool,
    owner: PeerProcess,
    http: aiohttp.ClientSession,
    registry: CollectorRegistry,
) -> None:
    peer = await connect(reader, http, owner)
    assert peer.engine_id == owner.engine_id
    await reader.read(peer, [3, 7, 9], [1, 2, 5], timeout=10)
    assert_blocks(pool, [1, 2, 5], P_SEED, [3, 7, 9])
    assert_untouched(pool, skip={1, 2, 5})
    nbytes = 3 * TEST_LAYOUT.block_bytes
    assert (reader.metrics.transfers, reader.metrics.bytes) == (1, nbytes)
    assert registry.get_sample_value("duet:kv_transfer_bytes_total") == nbytes
    assert registry.get_sample_value("duet:kv_transfer_seconds_count") == 1
    # Same metadata again: the cached peer, no second connection.
    assert await connect(reader, http, owner) is peer


async def test_read_256_non_contiguous_blocks(
    reader: Transport, pool: HostPool, owner: PeerProcess, http: aiohttp.ClientSession
) -> None:
    rng = random.Random(7)
    # Mostly scattered ids, plus one adjacent run on both sides so coalescing is exercised.
    remote = [100, 101, 102, 103, *rng.sample(range(104, TEST_LAYOUT.num_blocks), 252)]
    local = [10, 11, 12, 13, *rng.sample(range(20, TEST_LAYOUT.num_blocks), 252)]
    peer = await connect(reader, http, owner)
    await reader.read(peer, remote, local, timeout=20)
    assert_blocks(pool, local, P_SEED, remote)
    assert_untouched(pool, skip=set(local))


async def test_two_peers_read_concurrently_into_one_pool(
    reader: Transport,
    pool: HostPool,
    owner: PeerProcess,
    http: aiohttp.ClientSession,
    spawn: Callable[..., PeerProcess],
) -> None:
    other = spawn("P-other", 3)
    a, b = await asyncio.gather(connect(reader, http, owner), connect(reader, http, other))
    # Interleaved destinations: any mix-up between the two streams lands in a neighbour.
    rounds = []
    for r in range(4):
        local_a = list(range(r * 128, r * 128 + 128, 2))
        local_b = list(range(r * 128 + 1, r * 128 + 128, 2))
        remote_a = [(x * 7 + r) % TEST_LAYOUT.num_blocks for x in range(64)]
        remote_b = [(x * 11 + r) % TEST_LAYOUT.num_blocks for x in range(64)]
        rounds.append((local_a, remote_a, local_b, remote_b))
    await asyncio.gather(
        *(reader.read(a, ra, la, timeout=20) for la, ra, _, _ in rounds),
        *(reader.read(b, rb, lb, timeout=20) for _, _, lb, rb in rounds),
    )
    for la, ra, lb, rb in rounds:
        assert_blocks(pool, la, P_SEED, ra)
        assert_blocks(pool, lb, 3, rb)
    assert_untouched(pool, skip=set(range(512)))
    assert reader.metrics.transfers == 8


async def test_notification_reaches_the_owner(
    reader: Transport, owner: PeerProcess, http: aiohttp.ClientSession
) -> None:
    peer = await connect(reader, http, owner)
    await reader.notify(peer, b"release req-42")
    async with http.get(owner.url("/notifications"), params={"timeout": "10"}) as r:
        assert r.status == 200
        note = await r.json()
    assert note["engine_id"] == reader.engine_id
    assert base64.b64decode(note["message"]) == b"release req-42"


async def test_out_of_range_and_malformed_ids_refused_before_transfer(
    reader: Transport, pool: HostPool, owner: PeerProcess, http: aiohttp.ClientSession
) -> None:
    peer = await connect(reader, http, owner)
    n = TEST_LAYOUT.num_blocks
    cases = [
        (([3, n], [1, 2]), f"remote block id {n} is out of range [0, {n})"),
        (([3, 4], [1, n + 5]), f"local block id {n + 5} is out of range [0, {n})"),
        (([3, -1], [1, 2]), "remote block id -1 is out of range"),
        (([3, 4, 5], [1, 2]), "remote_block_ids has 3 ids but local_block_ids has 2"),
        (([3, 4], [1, 1]), "local block id 1 appears more than once"),
    ]
    for (remote, local), message in cases:
        with pytest.raises(BlockRangeError, match=re.escape(message)):
            await reader.read(peer, remote, local)
    assert reader.metrics.transfers == 0
    assert_untouched(pool, skip=set())
    # A refused request is the caller's mistake, not the peer's: it stays usable.
    await reader.read(peer, [0], [0])
    assert_blocks(pool, [0], P_SEED, [0])


async def test_layout_mismatch_refused_naming_each_difference(
    reader: Transport,
    pool: HostPool,
    http: aiohttp.ClientSession,
    spawn: Callable[..., PeerProcess],
) -> None:
    odd = spawn("P-odd", 5, {"num_kv_heads": 4, "dtype": "float32", "num_blocks": 100})
    md = await fetch_metadata(http, odd)
    with pytest.raises(LayoutMismatch) as e:
        await reader.add_peer(md)
    message = str(e.value)
    assert "'P-odd'" in message
    assert "num_kv_heads: 2 != 4" in message
    assert "dtype: float16 != float32" in message
    assert "num_blocks" not in message  # capacity is not part of compatibility
    assert e.value.differences == ["num_kv_heads: 2 != 4", "dtype: float16 != float32"]
    assert reader.get_peer("P-odd") is None
    with pytest.raises(PeerError, match="unknown peer 'P-odd'"):
        await reader.read("P-odd", [0], [0])
    assert_untouched(pool, skip=set())


async def test_killed_peer_raises_within_timeout(
    reader: Transport, http: aiohttp.ClientSession, spawn: Callable[..., PeerProcess]
) -> None:
    victim = spawn("P-victim", 9)
    peer = await connect(reader, http, victim)
    blocks = list(range(0, 512, 2))  # 256 non-contiguous blocks: each read takes a while
    await reader.read(peer, blocks, blocks, timeout=10)

    # Mid-transfer: reads run back to back while the owner is SIGKILLed under them.
    timeout = 3.0
    failure: list[BaseException] = []
    finished = asyncio.Event()

    async def keep_reading() -> None:
        try:
            while True:
                t0 = time.monotonic()
                try:
                    await reader.read(peer, blocks, blocks, timeout=timeout)
                except TransferError as e:
                    failure.append(e)
                    assert time.monotonic() - t0 < timeout + SLACK
                    return
        finally:
            finished.set()

    task = asyncio.create_task(keep_reading())
    await asyncio.sleep(0)  # let the first read start before the kill
    await asyncio.to_thread(victim.kill)
    await asyncio.wait_for(finished.wait(), timeout + SLACK + 5)
    await task
    assert isinstance(failure[0], (PeerError, TransferTimeout)), failure
    assert reader.get_peer("P-victim") is None  # dropped: the next request re-handshakes
    assert reader.metrics.failure_count >= 1

    # Before the transfer: a dead peer's old metadata fails fast too.
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        peer2 = await reader.add_peer(peer.metadata, timeout=timeout)
        await reader.read(peer2, [0, 1], [0, 1], timeout=timeout)
    assert time.monotonic() - t0 < 2 * timeout + SLACK


async def test_stopped_peer_never_hangs_a_read(
    backend: str,
    reader: Transport,
    pool: HostPool,
    http: aiohttp.ClientSession,
    spawn: Callable[..., PeerProcess],
) -> None:
    frozen = spawn("P-frozen", 11)
    peer = await connect(reader, http, frozen)
    frozen.proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    if backend == "nixl":
        # One-sided READ: once UCX's handshake (started by add_peer) is through, the owner's
        # CPU is not needed and a stopped owner is still read; until then the read waits for
        # it. Either way it returns within its timeout, with the right bytes if it succeeds.
        try:
            await reader.read(peer, [4, 5], [6, 7], timeout=1.0)
            assert_blocks(pool, [6, 7], 11, [4, 5])
        except TransferTimeout:
            assert_untouched(pool, skip={6, 7})
    else:
        # Two-sided backends need the owner to answer: the read must give up in time.
        with pytest.raises(TransferTimeout, match="timed out after 1 s"):
            await reader.read(peer, [4, 5], [6, 7], timeout=1.0)
        assert_untouched(pool, skip={6, 7})
    assert time.monotonic() - t0 < 1.0 + SLACK


def test_pattern_helpers_detect_a_wrong_block() -> None:
    """The oracle the tests rely on must fail on a wrong, shifted or foreign block."""
    pool = HostPool(TEST_LAYOUT, D_SEED)
    other = HostPool(TEST_LAYOUT, P_SEED)
    pool.blocks[1] = other.blocks[3]
    assert_blocks(pool, [1], P_SEED, [3])
    with pytest.raises(AssertionError):
        assert_blocks(pool, [1], P_SEED, [4])
    with pytest.raises(AssertionError):
        assert_untouched(pool, skip=set())
    pool.blocks[1] = np.roll(other.blocks[3], 8)
    with pytest.raises(AssertionError):
        assert_blocks(pool, [1], P_SEED, [3])
