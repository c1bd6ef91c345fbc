"""Per-request block tables on top of the BlockPool: prefix lookup, slot allocation, caching
of full blocks, and the P/D hooks.

Invariants:
- a request's `block_ids[i]` holds the KV of its tokens `[i*bs, (i+1)*bs)`;
- a prefix hit never covers a request's last known token: at least one token is computed so
  there are logits to sample from;
- a full block is registered in the prefix cache once its KV is computed (or arrived);
- hold/release (prefill node): a finished request's blocks stay referenced until released;
  reserve (decode node): blocks for remote KV are allocated before the transfer writes them;
- quarantine (decode node): blocks a failed transfer may still write into keep their
  reference under the request id, so the pool never hands them out, until the transport
  says the transfer is over (`release_quarantine`).

Digests (with a `digester`, the pool's bytes: engine/kv_digest.py): a full block's content digest
is taken when its KV is written (`cache_computed_blocks`) and kept with the block; a hit on a
released block (no request references it) is checked before the request uses it, and KV that
arrived from elsewhere is checked against the sender's digests (`verify`) before it counts as
computed. A mismatch fails closed: the block is dropped from the cache and its tokens are
recomputed; `checks` and `mismatches` count blocks by where the KV came from.

Spill tiers (with `tiers`, engine/kv_tiers.py): a request's prefix may continue past its pool
hit in the host or disk tier (`find_tiered`); admission loads those blocks into fresh pool blocks
and checks them before the request computes, and a block the pool caches anew leaves its tier.
`reused` counts the prompt tokens admission did not compute, by where their KV was (pool,
host, disk; a peer's pulled prefix is counted by the scheduler).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from engine import kv_moves
from engine.block_pool import BlockPool
from engine.request import Request
from protocol.block_hash import DEFAULT_HASH_SEED, domain_root, hash_block

if TYPE_CHECKING:
    from engine.kv_tiers import KVTiers


class Digester(Protocol):
    def digest(self, block_id: int, chain_hash: int, domain_root: int) -> int: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        enable_prefix_caching: bool = True,
        hash_seed: int = DEFAULT_HASH_SEED,
        digester: Digester | None = None,
        tiers: KVTiers | None = None,
    ) -> None:
        self.pool = pool
        self.digester = digester
        self.tiers = tiers if tiers is not None and tiers.enabled else None
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self._hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        self._num_cached: dict[str, int] = {}  # request id -> blocks registered in the cache
        self._quarantine: dict[str, list[int]] = {}  # request id -> blocks a late write may hit
        # Counters (DESIGN §4 prefix-cache metrics), in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0
        #: blocks whose digest was checked, and those that failed, by where their KV came from
        #: ("pool": a released block hit; "transfer": from a prefill node; "peer", "host", "disk")
        self.checks: Counter[str] = Counter()
        self.mismatches: Counter[str] = Counter()
        #: prompt tokens admission did not compute, by where their KV was (pool, host, disk,
        #: peer), and the prompt tokens of the requests it admitted to compute here
        self.reused: Counter[str] = Counter()
        self.reuse_queries = 0

    # -- hashing ---------------------------------------------------------------------------
    def block_hashes(self, req: Request, upto_tokens: int) -> list[int]:
        """Hashes of the request's full blocks within its first `upto_tokens` tokens,
        extended incrementally (a request's tokens only ever grow). The chain starts at the
        request's cache domain (`cache_salt`) and LoRA adapter, so two domains (or adapters)
        never share a cached block."""
        hs = self._hashes.setdefault(req.request_id, [])
        bs = self.block_size
        n_full = min(upto_tokens, req.num_tokens) // bs
        p = req.params  # the chain's root: the cache domain and the LoRA adapter
        root = domain_root(p.cache_salt, self.hash_seed, p.lora_name) if len(hs) < n_full else 0
        while len(hs) < n_full:
            i = len(hs)
            toks = [req.token_at(j) for j in range(i * bs, (i + 1) * bs)]
            hs.append(hash_block(hs[-1] if hs else root, toks, self.hash_seed))
        return hs[:n_full]

    # -- admission -------------------------------------------------------------------------
    def find_cached_prefix(self, req: Request, max_tokens: int | None = None) -> list[int]:
        """Blocks of the longest cached prefix of `req` (not yet referenced)."""
        limit = req.num_tokens - 1 if max_tokens is None else min(max_tokens, req.num_tokens - 1)
        if not self.enable_prefix_caching or limit < self.block_size or req.needs_prompt_logprobs:
            return []
        hit: list[int] = []
        for h in self.block_hashes(req, limit):
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def find_tiered(self, req: Request, start: int, max_tokens: int | None = None) -> list[int]:
        """Hashes of the blocks after the first `start` (the pool hit) that continue the
        request's prefix in a spill tier (never its last token, nor past `max_tokens`)."""
        limit = req.num_tokens - 1 if max_tokens is None else min(max_tokens, req.num_tokens - 1)
        if self.tiers is None or limit < self.block_size or req.needs_prompt_logprobs:
            return []
        out: list[int] = []
        for h in self.block_hashes(req, limit)[start:]:
            if self.tiers.where(h) is None:
                break
            out.append(h)
        return out

    def can_allocate(
        self, req: Request, num_new_tokens: int, cached: list[int], tiered: int = 0
    ) -> bool:
        """Room for `num_new_tokens` after the cached prefix and `tiered` blocks to load."""
        needed = (
            cdiv(
                req.num_computed_tokens + (len(cached) + tiered) * self.block_size + num_new_tokens,
                self.block_size,
            )
            - len(req.block_ids)
            - len(cached)
        )
        # Hits on free blocks take those blocks out of the free list.
        reclaimed = sum(1 for b in cached if self.pool.ref_count(b) == 0)
        return needed <= self.pool.num_free - reclaimed

    def admit(
        self,
        req: Request,
        cached: list[int],
        count_query: bool = True,
        tiered: Sequence[int] = (),
    ) -> list[int]:
        """Take references on the cached prefix (cut at the first released block whose digest
        fails), load the `tiered` blocks after it (`find_tiered`; can_allocate promised room),
        and mark those tokens computed. Returns the pool blocks of the prefix."""
        assert not req.block_ids and req.num_computed_tokens == 0
        got = kv_moves.checked_hits(self, req, cached)
        self.pool.touch(got)
        req.block_ids = list(got)
        # reuse is counted where the prompt is computed: not for KV a prefill node sends
        local = count_query and req.remote_num_tokens == 0
        if len(got) == len(cached) and tiered:
            kv_moves.load_tiered(self, req, tiered, local)
        req.num_computed_tokens = len(req.block_ids) * self.block_size
        req.num_cached_tokens = req.num_computed_tokens
        self._num_cached[req.request_id] = len(req.block_ids)
        if count_query:
            self.prefix_queries += req.num_prompt_tokens
            self.prefix_hits += req.num_computed_tokens
        if local:
            self.reuse_queries += req.num_prompt_tokens
            self.reused["pool"] += len(got) * self.block_size
        return got

    def count_pulled(self, req: Request, tokens: int) -> None:
        """A request that pulled `tokens` of its prefix from a peer (after its pool hit, the
        request's cached tokens) computes the rest here: count its reuse."""
        self.reuse_queries += req.num_prompt_tokens
        self.reused["pool"] += req.num_cached_tokens
        self.reused["peer"] += max(0, tokens)

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Ensure blocks for `num_computed_tokens + num_new_tokens` tokens; False if the pool
        cannot (nothing changes then)."""
        needed = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - len(
            req.block_ids
        )
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        req.block_ids.extend(self.pool.allocate(needed))
        return True

    # -- after compute ---------------------------------------------------------------------
    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        done = self._num_cached.get(req.request_id, 0)
        n_full = req.num_computed_tokens // self.block_size
        if n_full <= done:
            return
        hs = self.block_hashes(req, n_full * self.block_size)
        bs = self.block_size
        root = domain_root(req.params.cache_salt, self.hash_seed) if self.digester else 0
        for i in range(done, n_full):
            b = req.block_ids[i]
            if self.digester is not None and self.pool.digest(b) is None:
                self.pool.set_digest(b, self.digester.digest(b, hs[i], root))
            toks = [req.token_at(j) for j in range(i * bs, (i + 1) * bs)]
            self.pool.cache(b, hs[i], hs[i - 1] if i else None, toks)
            if self.tiers is not None and self.pool.lookup(hs[i]) == b:
                self.tiers.discard(hs[i])  # computed anew: the spilled copy is stale news
        self._num_cached[req.request_id] = n_full

    def trim(self, req: Request, num_tokens: int) -> int:
        """Speculative decoding's rollback: free the blocks past those `num_tokens` tokens need
        (slots allocated for draft tokens that were rejected). Their KV was never registered in
        the prefix cache (only computed, accepted blocks are). Returns how many were freed."""
        keep = cdiv(num_tokens, self.block_size)
        extra = req.block_ids[keep:]
        if extra:
            self.pool.free(extra[::-1])
            req.block_ids = req.block_ids[:keep]
        return len(extra)

    # -- digests of KV that moves (engine/kv_moves.py) -------------------------------------
    def transfer_digests(self, req: Request) -> list[int] | None:
        return kv_moves.transfer_digests(self, req)

    def share(self, hashes: Sequence[int], root: int) -> tuple[list[int], list[int]]:
        return kv_moves.share(self, hashes, root)

    # -- release ---------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Drop the request's references (tail first, so its suffix is evicted first)."""
        self.pool.free(req.block_ids[::-1])
        req.block_ids = []
        self._num_cached.pop(req.request_id, None)

    def forget(self, req: Request) -> None:
        """Drop per-request bookkeeping once the request is gone for good."""
        self._hashes.pop(req.request_id, None)
        self._num_cached.pop(req.request_id, None)

    def reset_cache(self) -> bool:
        """Forget every cached block, the spill tiers' too (False while blocks are in use)."""
        if not self.pool.reset_cache():
            return False
        if self.tiers is not None:
            self.tiers.clear()
        return True

    def reset_for_recompute(self, req: Request) -> None:
        """Preemption by recompute: blocks back to the pool, progress back to zero."""
        self.free(req)
        req.num_computed_tokens = 0

    # -- quarantine ------------------------------------------------------------------------
    def quarantine(self, req: Request, first_block: int) -> int:
        """Take `req.block_ids[first_block:]` away from the request without freeing them: a
        transfer that could not be stopped may still write there. Returns how many."""
        blocks = req.block_ids[first_block:]
        if blocks:
            self._quarantine.setdefault(req.request_id, []).extend(blocks)
        req.block_ids = req.block_ids[:first_block]
        self._num_cached[req.request_id] = min(self._num_cached.get(req.request_id, 0), first_block)
        return len(blocks)

    def release_quarantine(self, request_id: str) -> int:
        """The transfer is known finished or dead: its quarantined blocks go back to the pool."""
        blocks = self._quarantine.pop(request_id, [])
        self.pool.free(blocks[::-1])
        return len(blocks)

    @property
    def num_quarantined(self) -> int:
        return sum(map(len, self._quarantine.values()))

    def quarantined(self, request_id: str) -> list[int]:
        return list(self._quarantine.get(request_id, []))
