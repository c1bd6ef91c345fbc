"""The spill tiers (engine/kv_tiers.py) under a block pool: exact LRU order pool → host → disk,
budgets, pins, the events that say where each block is, and loads checked against digests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.block_pool import BlockPool, BlockRemoved, BlockStored
from engine.kv_digest import PoolBytes
from engine.kv_manager import KVCacheManager
from engine.kv_stores import DiskStore, HostStore, StoreError
from engine.kv_tiers import KVTiers, Medium
from engine.request import Request
from protocol.block_hash import block_hashes
from protocol.sampling import SamplingParams

BS = 4
BLOCK_BYTES = 64


def make(tmp: Path, blocks: int, host: int, disk: int) -> tuple[BlockPool, KVTiers, PoolBytes]:
    data = PoolBytes(torch.zeros(blocks, BLOCK_BYTES, dtype=torch.uint8))
    pool = BlockPool(blocks, BS, record_events=True)
    tiers = KVTiers(
        data,
        BS,
        HostStore(host, BLOCK_BYTES),
        DiskStore(tmp / "kv", BLOCK_BYTES),
        disk,
        emit=pool.record,
    )
    pool.on_evict = tiers.spill
    return pool, tiers, data


def fill(pool: BlockPool, data: PoolBytes, hashes: list[int]) -> list[int]:
    """Allocate, write a pattern, cache and release one block per hash (in this order)."""
    out = []
    for h in hashes:
        (b,) = pool.allocate(1)
        data.row(b).fill_(h % 251)
        pool.cache(b, h, None, [h] * BS)
        pool.set_digest(b, h * 7)
        pool.free([b])
        out.append(b)
    return out


def where(ev: BlockStored | BlockRemoved) -> tuple[str, list[int], str | None]:
    return type(ev).__name__, ev.block_hashes, ev.medium


def test_evictions_move_down_the_tiers_lru_first(tmp_path: Path) -> None:
    pool, tiers, data = make(tmp_path, blocks=2, host=2, disk=2)
    fill(pool, data, [1, 2])
    pool.drain_events()
    fill(pool, data, [3, 4, 5, 6, 7])
    # pool holds 6 and 7; 1..5 were evicted in order: host keeps the 2 newest, disk the 2
    # before; the oldest dropped off the end
    assert tiers.hashes(Medium.HOST) == [4, 5]
    assert tiers.hashes(Medium.DISK) == [2, 3]
    assert tiers.where(1) is None and tiers.where(6) is None
    moves = [where(e) for e in pool.drain_events() if e.medium is not None]
    assert moves == [
        ("BlockStored", [1], "host"),
        ("BlockStored", [2], "host"),
        ("BlockStored", [1], "disk"),
        ("BlockStored", [3], "host"),
        ("BlockStored", [2], "disk"),
        ("BlockStored", [4], "host"),
        ("BlockRemoved", [1], "disk"),
        ("BlockStored", [3], "disk"),
        ("BlockStored", [5], "host"),
    ]
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == [f"{h:016x}.kv" for h in (2, 3)]


def test_load_returns_bytes_and_digest_and_leaves_the_tier(tmp_path: Path) -> None:
    pool, tiers, data = make(tmp_path, blocks=2, host=1, disk=4)
    fill(pool, data, [10, 11, 12, 13])  # 10, 11 evicted: 10 to disk (demoted), 11 on host
    assert tiers.where(10) is Medium.DISK and tiers.where(11) is Medium.HOST
    (b,) = pool.allocate(1)  # evicts 12 to host, demoting 11 to disk
    assert tiers.load(10, b) == (Medium.DISK, 70)
    assert bool((data.row(b) == 10).all()) and tiers.where(10) is None
    assert not (tmp_path / "kv" / f"{10:016x}.kv").exists()
    assert tiers.load(12, b) == (Medium.HOST, 84) and bool((data.row(b) == 12).all())
    assert tiers.load(99, b) is None


def test_pinned_entries_stay_put(tmp_path: Path) -> None:
    pool, tiers, data = make(tmp_path, blocks=1, host=1, disk=1)
    fill(pool, data, [1, 2])  # 1 on host
    tiers.pin(1)
    fill(pool, data, [3])  # 2 cannot take the pinned host slot: straight to disk
    assert tiers.where(1) is Medium.HOST and tiers.where(2) is Medium.DISK
    tiers.pin(2)
    fill(pool, data, [4])  # 3 has nowhere to go: dropped
    assert tiers.where(3) is None
    assert BlockRemoved(block_hashes=[3]) in pool.drain_events()  # gone from the pool
    tiers.unpin(1)
    fill(pool, data, [5])  # 4 takes the host slot; 1 cannot go to the pinned disk: dropped
    assert tiers.where(4) is Medium.HOST and tiers.where(1) is None


def test_a_block_without_a_digest_is_not_spilled(tmp_path: Path) -> None:
    pool, tiers, _ = make(tmp_path, blocks=1, host=1, disk=0)
    (b,) = pool.allocate(1)
    pool.cache(b, 5, None, [0] * BS)
    pool.free([b])
    pool.allocate(1)
    assert tiers.where(5) is None and len(tiers) == 0


def test_the_disk_store_refuses_a_file_of_another_block(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 8)
    store.write(1, memoryview(b"abcdefgh"))
    (tmp_path / f"{1:016x}.kv").rename(tmp_path / f"{2:016x}.kv")
    with pytest.raises(StoreError, match="holds block 0000000000000001"):
        store.read_into(2, memoryview(bytearray(8)))
    with pytest.raises(StoreError):
        store.read_into(3, memoryview(bytearray(8)))
    (tmp_path / "left.kv").write_bytes(b"x")
    DiskStore(tmp_path, 8)  # a new store owns the directory: stale blocks are gone
    assert not list(tmp_path.glob("*.kv"))


def _manager(tmp: Path, blocks: int) -> tuple[KVCacheManager, PoolBytes]:
    data = PoolBytes(torch.zeros(blocks, BLOCK_BYTES, dtype=torch.uint8))
    pool = BlockPool(blocks, BS, record_events=True)
    tiers = KVTiers(
        data, BS, HostStore(2, BLOCK_BYTES), DiskStore(tmp, BLOCK_BYTES), 8, pool.record
    )
    pool.on_evict = tiers.spill
    return KVCacheManager(pool, digester=data, tiers=tiers), data


def _compute(kv: KVCacheManager, data: PoolBytes, rid: str, prompt: list[int]) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=1))
    cached = kv.find_cached_prefix(req)
    tiered = kv.find_tiered(req, len(cached))
    assert kv.can_allocate(req, len(prompt) - (len(cached) + len(tiered)) * BS, cached, len(tiered))
    kv.admit(req, cached, tiered=tiered)
    assert kv.allocate_slots(req, len(prompt) - req.num_computed_tokens)
    for i in range(req.num_computed_tokens // BS, len(req.block_ids)):
        data.row(req.block_ids[i]).fill_(prompt[i * BS])  # "compute" the block's KV
    req.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(req)
    return req


def test_admission_loads_a_spilled_prefix_and_checks_it(tmp_path: Path) -> None:
    kv, data = _manager(tmp_path, blocks=4)
    a = list(range(100, 113))  # 3 full blocks + 1
    kv.free(_compute(kv, data, "a", a))
    # b takes the pool: a's blocks leave tail first (its prefix outlives its suffix), to the
    # host tier, whose oldest entry then moves to disk
    kv.free(_compute(kv, data, "b", list(range(200, 213))))
    assert kv.tiers is not None
    hs = block_hashes(a, BS)
    assert [kv.tiers.where(h) for h in hs] == [Medium.HOST, Medium.HOST, Medium.DISK]
    again = _compute(kv, data, "a2", a)
    assert again.num_cached_tokens == 12 and kv.reused == {"pool": 0, "host": 8, "disk": 4}
    assert kv.checks == {"host": 2, "disk": 1} and not kv.mismatches
    assert [kv.pool.lookup(h) for h in hs] == again.block_ids[:3]


def test_a_corrupt_spilled_block_is_dropped_and_recomputed(tmp_path: Path) -> None:
    kv, data = _manager(tmp_path, blocks=4)
    a = list(range(100, 113))
    kv.free(_compute(kv, data, "a", a))
    kv.free(_compute(kv, data, "b", list(range(200, 213))))
    last = block_hashes(a, BS)[2]  # on disk
    path = tmp_path / f"{last:016x}.kv"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1  # a byte of the payload flipped on disk
    path.write_bytes(bytes(raw))
    again = _compute(kv, data, "a2", a)
    assert again.num_cached_tokens == 8  # two good blocks from the host, the third recomputed
    assert kv.mismatches == {"disk": 1} and kv.checks == {"host": 2, "disk": 1}
    assert kv.tiers is not None and kv.tiers.where(last) is None
    assert bool((data.row(again.block_ids[2]) == a[8]).all())  # computed again, not loaded


def test_a_share_holds_pool_and_spilled_blocks_until_released_or_expired(tmp_path: Path) -> None:
    from engine.holds import Claim, HoldLedger
    from engine.shares import Shares
    from protocol.block_hash import domain_root

    kv, data = _manager(tmp_path, blocks=4)
    a = list(range(100, 113))
    kv.free(_compute(kv, data, "a", a))
    kv.free(_compute(kv, data, "b", list(range(200, 213))))  # a's blocks on host and disk
    ledger = HoldLedger()
    shares = Shares(kv, ledger)
    hs = block_hashes(a, BS)
    free = kv.pool.num_free
    blocks, digests = shares.share("s1", hs + [12345], domain_root(None), lease_s=5.0)
    # the three known blocks, loaded back (checked) and referenced; the unknown hash ends it
    assert len(blocks) == 3 and [kv.pool.lookup(h) for h in hs] == blocks
    assert digests == [kv.pool.digest(b) for b in blocks] and kv.checks == {"host": 2, "disk": 1}
    assert all(kv.pool.ref_count(b) == 1 for b in blocks) and kv.pool.num_free < free
    assert ledger.claim("s1", [9], 0.0) == (Claim.NOT_THEIRS, 0)
    assert shares.next_expiry() is not None and not shares.expire(0.0)
    assert shares.expire(shares.next_expiry() or 0.0) == ["s1"]  # the lease ran out
    assert all(kv.pool.ref_count(b) == 0 for b in blocks) and "s1" not in shares
    again, _ = shares.share("s2", hs, domain_root(None), lease_s=5.0)
    assert again == blocks  # from the pool now
    assert ledger.claim("s2", again, 0.0) == (Claim.OK, 3) and shares.release("s2")
    # another domain's prompt hashes differently: nothing of this one matches
    other = block_hashes(a, BS, parent=domain_root("team:x"))
    assert shares.share("s3", other, domain_root("team:x"), 5.0) == ([], [])


def test_a_reservation_for_remote_kv_loads_the_local_spilled_prefix_first(tmp_path: Path) -> None:
    from engine.scheduler import Scheduler, SchedulerConfig

    kv, data = _manager(tmp_path, blocks=8)
    a = list(range(100, 113))
    kv.free(_compute(kv, data, "a", a))
    kv.free(_compute(kv, data, "b", list(range(200, 229))))  # 8 blocks: a's go to the tiers
    assert kv.tiers is not None and len(kv.tiers) == 3
    s = Scheduler(SchedulerConfig(), kv)
    s.add(Request("d", a + [7, 8, 9], SamplingParams(max_tokens=1), remote_num_tokens=16))
    out = s.schedule()
    (req,) = out.reserved
    # the remote KV covers the first 16 tokens; the local tiers hold them (loaded, checked),
    # so the transfer has nothing left to fill before the local prefix ends
    assert req.num_cached_tokens == 12 and len(req.block_ids) == 4
    assert kv.checks["host"] + kv.checks["disk"] == 3


def test_a_prefix_cache_reset_empties_the_tiers(tiny_llama: Path, tmp_path: Path) -> None:
    """Sleep (and a LoRA name loaded with other weights) resets the prefix cache: the spilled
    blocks go with the pool's, or a block of the old weights would be a hit after it."""
    from engine import EngineConfig
    from engine.core import EngineCore

    cfg = EngineConfig(
        model=str(tiny_llama),
        dtype="float32",
        num_kv_blocks=8,
        max_model_len=128,
        kv_host_bytes="1MiB",
        kv_disk_bytes="4MiB",
        kv_disk_dir=str(tmp_path),
    )
    core = EngineCore(cfg)
    a, b = list(range(10, 70)), list(range(100, 200))
    for rid, prompt in (("a", a), ("b", b)):  # b's blocks evict a's into the tiers
        core.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while core.scheduler.requests:
            core.step()
    assert core.tiers is not None and len(core.tiers) >= 2
    core.sleep()
    assert len(core.tiers) == 0 and not list(tmp_path.glob("*.kv"))
    assert core.tiers.host is not None and core.tiers.host.num_free == core.tiers.host.slots
    core.add_request("a2", a, SamplingParams(max_tokens=1, ignore_eos=True))
    outs = []
    while core.scheduler.requests:
        outs += core.step()[0]
    assert outs[-1].num_cached_tokens == 0
