"""Content digests of KV blocks (protocol/kv_digest.py): taken when a block's KV is written,
checked before reused or arrived KV is used, failing closed. Every flipped block is caught, and
no answer changes: the corrupt block's tokens are recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineConfig, SamplingParams
from engine.block_pool import BlockPool, BlockRemoved
from engine.core import EngineCore
from protocol.block_hash import block_hashes, domain_root
from protocol.kv_digest import (
    KVCheck,
    block_digest,
    finish_digest,
    hash_bytes,
    tail_chain_hash,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [(7 * i) % 300 + 3 for i in range(53)]  # 3 full blocks of 16 and a 5-token tail


def run(core: EngineCore, rid: str, prompt: list[int], **kw: object) -> list[int]:
    core.add_request(rid, prompt, kw.pop("params", GREEDY), **kw)  # type: ignore[arg-type]
    toks: list[int] = []
    while True:
        outs, _ = core.step()
        for o in outs:
            if o.request_id == rid:
                toks += o.new_token_ids
                if o.finished:
                    return toks


@pytest.fixture
def core(tiny_llama: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64))


def flip(core: EngineCore, block_id: int, at: int = 1000) -> None:
    core.pool_bytes.row(block_id)[at] ^= 0x40


def test_digests_reset_on_reuse_and_uncache_reports_removal() -> None:
    pool = BlockPool(2, 4, record_events=True)
    a, b = pool.allocate(2)
    pool.cache(a, 11, None, [1, 2, 3, 4])
    pool.set_digest(a, 99)
    pool.free([a, b])
    assert pool.digest(a) == 99
    assert pool.uncache(a) and pool.lookup(11) is None and pool.digest(a) is None
    assert not pool.uncache(a)
    assert pool.drain_events()[-1] == BlockRemoved(block_hashes=[11])
    pool.set_digest(b, 5)
    assert pool.allocate(2) and pool.digest(b) is None


def test_digest_binds_bytes_chain_and_domain() -> None:
    data = bytes(range(256)) * 4
    d = block_digest(data, 1, 2)
    assert d == block_digest(memoryview(data), 1, 2)
    assert len({d, block_digest(data, 3, 2), block_digest(data, 1, 4)}) == 3
    assert block_digest(data[:-1] + b"\x00", 1, 2) != d
    # hashing the bytes first and binding later (where the bytes land) is the same digest,
    # and one state binds to any chain and domain
    state = hash_bytes(data)
    assert finish_digest(state, 1, 2) == d and finish_digest(state, 3, 2) != d
    assert finish_digest(state, 1, 2) == d


def test_written_blocks_carry_the_digest_of_their_bytes(core: EngineCore) -> None:
    run(core, "a", PROMPT)
    hs = block_hashes(PROMPT, 16, parent=domain_root(None))
    root = domain_root(None)
    for h in hs:
        b = core.pool.lookup(h)
        assert b is not None
        assert core.pool.digest(b) == block_digest(core.pool_bytes.view(b), h, root)


def test_a_flipped_released_block_is_caught_and_the_answer_unchanged(
    core: EngineCore, tiny_llama: Path
) -> None:
    want = run(core, "a", PROMPT)
    computed = core.counters.prompt_tokens_computed
    hs = block_hashes(PROMPT, 16, parent=domain_root(None))
    second = core.pool.lookup(hs[1])
    assert second is not None and core.pool.ref_count(second) == 0  # released, still cached
    flip(core, second)
    assert run(core, "b", PROMPT) == want
    assert core.kv.mismatches == {"pool": 1}
    # block 0 was a good hit; block 1 and everything after it were computed again
    assert core.counters.prompt_tokens_computed - computed == len(PROMPT) - 16
    # the recomputed block is cached again under its hash, with a good digest
    again = core.pool.lookup(hs[1])
    assert again is not None and run(core, "c", PROMPT) == want
    assert core.kv.mismatches == {"pool": 1} and core.kv.checks["pool"] >= 5


def _transfer(
    p: EngineCore, d: EngineCore, flipped: set[int], landed: set[int] | None = None
) -> KVCheck:
    """P prefills and holds; its blocks' bytes are copied into D's reserved blocks (what the
    transport does), those at `flipped` positions corrupted on the way; D checks P's digests.
    `landed`: the positions whose bytes are hashed as they land (kvtransfer/hashed_read.py),
    after the corruption, and handed to the engine with the digests."""
    run(p, "p", PROMPT, params=SamplingParams(max_tokens=1), hold_blocks=True)
    held = p.held_kv("p")
    assert held is not None
    src, digests = held
    assert digests is not None and len(digests) == len(src) == 4
    d.add_request("d", PROMPT, GREEDY, remote_num_tokens=len(PROMPT))
    _, reserved = d.step()
    dst = reserved[0].block_ids
    hashed = {}
    for i, (s, t) in enumerate(zip(src, dst, strict=True)):
        d.pool_bytes.row(t).copy_(p.pool_bytes.row(s))
        if i in flipped:
            flip(d, t, at=77 + i)
        if landed is not None and i in landed:
            hashed[t] = hash_bytes(d.pool_bytes.view(t))
    return d.kv_ready(
        "d", True, digests=list(digests), hashed=hashed if landed is not None else None
    )


@pytest.mark.parametrize("flipped", [set(), {2}, {3}, {0, 3}])
@pytest.mark.parametrize(
    "landed", [None, {0, 1, 2, 3}, {1, 3}], ids=["engine-hashes", "all-landed", "some-landed"]
)
def test_transferred_blocks_are_checked_against_the_senders_digests(
    tiny_llama: Path, flipped: set[int], landed: set[int] | None
) -> None:
    """Whether the engine hashes the blocks or binds the hashes taken as they landed (all of
    them, or some: the others it hashes itself), every flipped block is caught."""
    cfg = EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64)
    p, d, ref = EngineCore(cfg), EngineCore(cfg), EngineCore(cfg)
    want = run(ref, "r", PROMPT)
    check = _transfer(p, d, flipped, landed)
    assert check is (KVCheck.MISMATCH if flipped else KVCheck.READY)
    toks: list[int] = []
    while len(toks) < GREEDY.max_tokens:
        toks += [t for o in d.step()[0] for t in o.new_token_ids]
    assert toks == want
    first_bad = min(flipped, default=4)
    assert d.kv.mismatches == ({"transfer": 1} if flipped else {})
    # D computed the tokens from the first bad block on (the last prompt token at least)
    assert d.counters.prompt_tokens_computed == len(PROMPT) - min(first_bad * 16, len(PROMPT) - 1)


def test_the_tail_digest_binds_the_partial_tokens(tiny_llama: Path) -> None:
    cfg = EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64)
    p = EngineCore(cfg)
    run(p, "p", PROMPT, params=SamplingParams(max_tokens=1), hold_blocks=True)
    held = p.held_kv("p")
    assert held is not None and held[1] is not None
    blocks, digests = held
    hs = block_hashes(PROMPT, 16)
    chain = tail_chain_hash(hs[-1], PROMPT[48:])
    assert digests[3] == block_digest(p.pool_bytes.view(blocks[3]), chain, domain_root(None))
