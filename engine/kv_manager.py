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
"""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.request import Request
from protocol.block_hash import DEFAULT_HASH_SEED, domain_root, hash_block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        enable_prefix_caching: bool = True,
        hash_seed: int = DEFAULT_HASH_SEED,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self._hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        self._num_cached: dict[str, int] = {}  # request id -> blocks registered in the cache
        self._quarantine: dict[str, list[int]] = {}  # request id -> blocks a late write may hit
        # Counters (DESIGN §4 prefix-cache metrics), in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

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

    def can_allocate(self, req: Request, num_new_tokens: int, cached: list[int]) -> bool:
        needed = (
            cdiv(
                req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens,
                self.block_size,
            )
            - len(req.block_ids)
            - len(cached)
        )
        # Hits on free blocks take those blocks out of the free list.
        reclaimed = sum(1 for b in cached if self.pool.ref_count(b) == 0)
        return needed <= self.pool.num_free - reclaimed

    def admit(self, req: Request, cached: list[int], count_query: bool = True) -> None:
        """Take references on the cached prefix and mark those tokens computed."""
        assert not req.block_ids and req.num_computed_tokens == 0
        self.pool.touch(cached)
        req.block_ids = list(cached)
        req.num_computed_tokens = len(cached) * self.block_size
        req.num_cached_tokens = req.num_computed_tokens
        self._num_cached[req.request_id] = len(cached)
        if count_query:
            self.prefix_queries += req.num_prompt_tokens
            self.prefix_hits += req.num_computed_tokens

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
        for i in range(done, n_full):
            toks = [req.token_at(j) for j in range(i * bs, (i + 1) * bs)]
            self.pool.cache(req.block_ids[i], hs[i], hs[i - 1] if i else None, toks)
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
