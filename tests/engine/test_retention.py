"""Retention (engine/retention.py): the prefixes a client asked to keep are evicted from the pool
last, move down the spill tiers instead of being dropped, lapse with their ttl, and stay in
their cache domain."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.block_pool import BlockPool
from engine.kv_digest import PoolBytes
from engine.kv_stores import DiskStore, HostStore
from engine.kv_tiers import KVTiers, Medium
from engine.retention import Retention
from protocol.block_hash import block_hashes, domain_root
from protocol.retention import KVRetain
from protocol.sampling import SamplingParams

BS = 4
BLOCK_BYTES = 64
SEED = 7


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(tmp: Path, blocks: int, host: int, disk: int) -> tuple[BlockPool, KVTiers, PoolBytes]:
    data = PoolBytes(torch.zeros(blocks, BLOCK_BYTES, dtype=torch.uint8))
    pool = BlockPool(blocks, BS, record_events=True)
    tiers = KVTiers(
        data,
        BS,
        HostStore(host, BLOCK_BYTES),
        DiskStore(tmp / "kv", BLOCK_BYTES),
        disk,
        pool.record,
    )
    pool.on_evict = tiers.spill
    return pool, tiers, data


def fill(pool: BlockPool, data: PoolBytes, hashes: list[int]) -> None:
    for h in hashes:
        (b,) = pool.allocate(1)
        data.row(b).fill_(h % 251)
        pool.cache(b, h, None, [h] * BS)
        pool.set_digest(b, h * 7)
        pool.free([b])


def test_pool_evicts_retained_blocks_last_and_only_when_nothing_else_is_free() -> None:
    clock = Clock()
    keep = Retention(BS, SEED, clock)
    pool = BlockPool(3, BS)
    pool.retained = keep
    data = PoolBytes(torch.zeros(3, BLOCK_BYTES, dtype=torch.uint8))
    fill(pool, data, [1, 2, 3])  # 1 is the least recently freed
    keep.retain([1], ttl_s=300)
    pool.allocate(2)  # takes 2 and 3, not the older 1
    assert pool.lookup(1) is not None and pool.lookup(2) is None and pool.lookup(3) is None
    pool.allocate(1)  # only the retained one is free: it goes
    assert pool.lookup(1) is None


def test_retention_lapses_with_its_ttl_and_a_renewal_extends_it() -> None:
    clock = Clock()
    keep = Retention(BS, SEED, clock)
    keep.retain([1], ttl_s=300)
    clock.t += 200
    keep.retain([1], ttl_s=300)  # renewed: 300 s from now
    clock.t += 200
    assert keep(1)
    keep.retain([1], ttl_s=10)  # a shorter ask never shortens it
    clock.t += 101
    assert not keep(1)
    assert keep.tick() == 1 and len(keep) == 0


def test_retained_blocks_move_down_the_tiers_and_are_not_dropped(tmp_path: Path) -> None:
    pool, tiers, data = make(tmp_path, blocks=1, host=1, disk=1)
    keep = Retention(BS, SEED, Clock())
    pool.retained = tiers.retained = keep
    keep.retain([1], ttl_s=300)
    fill(pool, data, [1, 2])  # 1 spills to the host
    assert tiers.where(1) is Medium.HOST
    fill(pool, data, [3])  # 2 to the host: 1 moves down to disk, not dropped
    assert tiers.where(1) is Medium.DISK and tiers.where(2) is Medium.HOST
    fill(pool, data, [4, 5])  # the disk is full of a retained block: the others go instead
    assert tiers.where(1) is Medium.DISK
    assert tiers.moves["dropped_disk"] == 0 and tiers.moves["dropped_host"] >= 1
    # without the retention the same traffic drops it
    pool2, tiers2, data2 = make(tmp_path / "b", blocks=1, host=1, disk=1)
    fill(pool2, data2, [1, 2, 3, 4, 5])
    assert tiers2.where(1) is None


def test_a_prompt_is_retained_in_its_own_cache_domain_only() -> None:
    keep = Retention(BS, SEED, Clock())
    ids = list(range(10))  # two full blocks and a partial one
    retain = KVRetain(tokens=9, ttl_s=300)
    assert keep.retain_prompt(ids, SamplingParams(cache_salt="team-a", retain=retain)) == 2
    mine = block_hashes(ids[:8], BS, SEED, domain_root("team-a", SEED))
    theirs = block_hashes(ids[:8], BS, SEED, domain_root("team-b", SEED))
    assert all(keep(h) for h in mine) and not any(keep(h) for h in theirs)
    assert keep.retain_prompt(ids, SamplingParams(cache_salt="team-b")) == 0


def _cached_after_pressure(tiny_llama: Path, retain: KVRetain | None) -> tuple[int, int]:
    """A 49-token prompt (retained or not), then two other prompts that fill the 8-block pool:
    (the prompt's cached tokens when it comes back, the engine's retained-block count)."""
    from engine import EngineConfig
    from engine.core import EngineCore

    core = EngineCore(
        EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=8, max_model_len=128)
    )
    a = list(range(10, 59))
    runs = [
        ("a", a, retain),
        ("b", list(range(100, 170)), None),
        ("c", list(range(200, 270)), None),
    ]
    outs = []
    for rid, prompt, keep in [*runs, ("a2", a, None)]:
        core.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True, retain=keep))
        while core.scheduler.requests:
            outs += core.step()[0]
    return outs[-1].num_cached_tokens, int(core.stats()["kv_blocks_retained"])


def test_an_engine_keeps_a_retained_prefix_that_traffic_would_evict(tiny_llama: Path) -> None:
    assert _cached_after_pressure(tiny_llama, None) == (0, 0)
    assert _cached_after_pressure(tiny_llama, KVRetain(tokens=49, ttl_s=300)) == (48, 3)
