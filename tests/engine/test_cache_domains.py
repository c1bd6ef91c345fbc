"""The engine's prefix cache never matches across cache domains (DESIGN §8): a
request's `cache_salt` roots its block-hash chain, so an identical prompt in another domain
finds nothing cached, the same domain finds its blocks, and the stored events carry the same
salted hashes the gateway routes with (protocol.block_hash)."""

from __future__ import annotations

from engine.block_pool import BlockPool, BlockStored
from engine.kv_manager import KVCacheManager
from engine.request import Request
from protocol.block_hash import block_hashes, domain_root
from protocol.sampling import SamplingParams

BS = 4
PROMPT = list(range(100, 113))  # 3 full blocks and one token


def cached_blocks(kv: KVCacheManager, rid: str, salt: str | None) -> int:
    return len(
        kv.find_cached_prefix(Request(rid, PROMPT, SamplingParams(max_tokens=4, cache_salt=salt)))
    )


def test_an_identical_prompt_hits_only_in_its_own_domain() -> None:
    kv = KVCacheManager(BlockPool(32, BS, record_events=True))
    a = Request("a", PROMPT, SamplingParams(max_tokens=4, cache_salt="team:a"))
    kv.admit(a, [])
    assert kv.allocate_slots(a, len(PROMPT))
    a.num_computed_tokens = len(PROMPT)
    kv.cache_computed_blocks(a)
    assert cached_blocks(kv, "a2", "team:a") == 3
    assert cached_blocks(kv, "b", "team:b") == 0
    assert cached_blocks(kv, "plain", None) == 0
    stored = [h for ev in kv.pool.events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert stored == block_hashes(PROMPT, BS, parent=domain_root("team:a"))
