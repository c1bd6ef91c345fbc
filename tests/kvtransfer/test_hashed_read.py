"""Reads whose blocks are reported and hashed as they land (kvtransfer/hashed_read.py), between
two real processes per backend: every block reported once, in order, only once its bytes are
the owner's; the hash states are those of the bytes read, and a block that is not what the
sender digested fails its check."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

import kvtransfer.nixl_transport as nixl_transport
from kvtransfer import Transport
from kvtransfer.hashed_read import HASH_JOB_BYTES, OVERLAP_ENV, read_hashed, spare_core
from protocol.kv_digest import block_digest, finish_digest
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool, assert_blocks, block_words
from tests.kvtransfer.procs import PeerProcess
from tests.kvtransfer.test_transfer import (  # noqa: F401 - fixtures
    P_SEED,
    backend,
    connect,
    http,
    owner,
    pool,
    reader,
    registry,
)

pytestmark = pytest.mark.timeout(120)

#: a last chunk of 16 test blocks (256 KiB): a read of 100 blocks lands in 4 (36, 32, 16, 16)
CHUNK_BLOCKS = 16


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_transport, "LANDED_TAIL_BYTES", CHUNK_BLOCKS * TEST_LAYOUT.block_bytes)


def scattered(n: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return rng.sample(range(TEST_LAYOUT.num_blocks), n), rng.sample(
        range(TEST_LAYOUT.num_blocks), n
    )


async def test_landed_reports_each_block_once_in_order_with_its_final_bytes(
    backend: str,  # noqa: F811  (the fixtures imported above)
    reader: Transport,  # noqa: F811
    pool: HostPool,  # noqa: F811
    owner: PeerProcess,  # noqa: F811
    http: object,  # noqa: F811
) -> None:
    remote, local = scattered(100, 1)
    peer = await connect(reader, http, owner)  # type: ignore[arg-type]
    calls: list[list[int]] = []

    def landed(ids: Sequence[int]) -> None:
        ids = list(ids)
        n = sum(map(len, calls))
        # the blocks reported hold the owner's bytes already, and are the next ones in order
        assert_blocks(pool, ids, P_SEED, remote[n : n + len(ids)])
        calls.append(ids)

    await reader.read(peer, remote, local, timeout=20, landed=landed)
    assert [b for c in calls for b in c] == local
    # nixl on one host copies chunk by chunk, tcp streams run by run; ucx has one completion
    assert len(calls) > 1 if backend in ("nixl", "tcp") else len(calls) == 1


async def test_hash_states_are_those_of_the_bytes_read(
    reader: Transport,  # noqa: F811  (the fixtures imported above)
    pool: HostPool,  # noqa: F811
    owner: PeerProcess,  # noqa: F811
    http: object,  # noqa: F811
) -> None:
    peer = await connect(reader, http, owner)  # type: ignore[arg-type]
    # hashed beside the read (one job per landed block, or the default gathering), and after it
    for seed, (overlap, job_bytes) in enumerate([(True, 1), (True, HASH_JOB_BYTES), (False, 0)]):
        remote, local = scattered(100, seed)
        states = await read_hashed(
            reader, peer, remote, local, timeout=20, overlap=overlap, job_bytes=job_bytes
        )
        assert sorted(states) == sorted(local)
        for i, (r, b) in enumerate(zip(remote, local, strict=True)):
            sent = block_digest(block_words(TEST_LAYOUT, P_SEED, r).tobytes(), i, 7)
            assert finish_digest(states[b], i, 7) == sent == block_digest(pool.blocks[b], i, 7)


async def test_a_block_other_than_the_one_digested_fails_its_check(
    reader: Transport,  # noqa: F811  (the fixtures imported above)
    pool: HostPool,  # noqa: F811
    owner: PeerProcess,  # noqa: F811
    http: object,  # noqa: F811
) -> None:
    """The sender digested one byte flipped in block 5 (what a reader sees when the bytes
    changed after the digest was taken): that block, and only it, fails."""
    remote, local = scattered(40, 3)
    sent = []
    for i, r in enumerate(remote):
        data = block_words(TEST_LAYOUT, P_SEED, r).copy()
        if i == 5:
            data[100] ^= np.uint8(1)
        sent.append(block_digest(data.tobytes(), i, 7))
    peer = await connect(reader, http, owner)  # type: ignore[arg-type]
    states = await read_hashed(reader, peer, remote, local, timeout=20, overlap=True)
    bad = [i for i, b in enumerate(local) if finish_digest(states[b], i, 7) != sent[i]]
    assert bad == [5]


def test_the_overlap_default_can_be_forced_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OVERLAP_ENV, "1")
    assert spare_core()
    monkeypatch.setenv(OVERLAP_ENV, "0")
    assert not spare_core()
