"""The vLLM KV-events bridge's hash recomputation (node.engines.vllm_events): vLLM's events,
encoded as vLLM's publisher encodes them, become duet events whose hashes equal
protocol.block_hash's for the same tokens, so the coordinator's index works unchanged. Pure:
runs without vLLM."""

from __future__ import annotations

import random

import msgspec

from node.engines.vllm_events import HashTranslator, VCleared, VRemoved, VStored, decode_batch
from protocol.block_hash import block_hashes
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 16


def vhash(i: int) -> bytes:
    """vLLM's sha256-style block hashes are opaque bytes (they never equal duet's)."""
    return i.to_bytes(4, "big") * 8


def test_a_chain_stored_in_pieces_gets_duets_hashes() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(50000) for _ in range(5 * BS)]
    t = HashTranslator(BS)
    # vLLM announces a prompt's blocks in two events (e.g. two chunked-prefill steps).
    out = t.translate(
        [
            VStored(
                block_hashes=[vhash(1), vhash(2)],
                parent_block_hash=None,
                token_ids=tokens[: 2 * BS],
                block_size=BS,
            ),
            VStored(
                block_hashes=[vhash(3), vhash(4), vhash(5)],
                parent_block_hash=vhash(2),
                token_ids=tokens[2 * BS :],
                block_size=BS,
            ),
        ]
    )
    want = block_hashes(tokens, BS)
    assert isinstance(out[0], BlockStored) and isinstance(out[1], BlockStored)
    assert out[0].block_hashes + out[1].block_hashes == want
    assert out[0].parent_block_hash is None and out[1].parent_block_hash == want[1]
    assert out[1].token_ids == tokens[2 * BS :]
    assert sorted(t.cached_hashes()) == sorted(want)
    # Removal translates through the map; an unknown hash is ignored.
    out = t.translate([VRemoved(block_hashes=[vhash(5), vhash(99)])])
    assert out == [BlockRemoved(block_hashes=[want[4]])]
    assert sorted(t.cached_hashes()) == sorted(want[:4])
    assert t.translate([VCleared()]) == [AllBlocksCleared()] and t.cached_hashes() == []


def test_unknown_parent_or_partial_block_is_dropped_not_guessed() -> None:
    t = HashTranslator(BS)
    tokens = list(range(2 * BS))
    assert (
        t.translate(
            [
                VStored(
                    block_hashes=[vhash(7)],
                    parent_block_hash=vhash(6),
                    token_ids=tokens[:BS],
                    block_size=BS,
                )
            ]
        )
        == []
    )
    assert (
        t.translate(
            [
                VStored(
                    block_hashes=[vhash(8)],
                    parent_block_hash=None,
                    token_ids=tokens[:5],
                    block_size=BS,
                )
            ]
        )
        == []
    )
    assert (
        t.translate(
            [
                VStored(
                    block_hashes=[vhash(9)],
                    parent_block_hash=None,
                    token_ids=tokens[:24],
                    block_size=24,
                )
            ]
        )
        == []
    )  # not a multiple of duet's block
    assert t.dropped == 3 and t.cached_hashes() == []
    # The child of a dropped block is dropped too: its chain is unknown.
    assert (
        t.translate(
            [
                VStored(
                    block_hashes=[vhash(10)],
                    parent_block_hash=vhash(7),
                    token_ids=tokens[BS:],
                    block_size=BS,
                )
            ]
        )
        == []
    )


def test_decodes_vllms_wire_format() -> None:
    """vLLM's EventBatch is array-like [ts, events, dp_rank]; events are tagged msgpack maps with
    extra fields (lora_id, medium, ...) the bridge ignores; hashes may be ints."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(2 * BS)),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    removed = {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}
    payload = msgspec.msgpack.encode([1.5, [stored, removed, {"type": "AllBlocksCleared"}], None])
    batch = decode_batch(payload)
    assert [type(e) for e in batch.events] == [VStored, VRemoved, VCleared]
    out = HashTranslator(BS).translate(batch.events)
    assert out[0] == BlockStored(
        block_hashes=block_hashes(list(range(2 * BS)), BS),
        parent_block_hash=None,
        token_ids=list(range(2 * BS)),
        block_size=BS,
    )
    assert isinstance(out[1], BlockRemoved) and out[1].block_hashes == [out[0].block_hashes[1]]
    assert out[2] == AllBlocksCleared()


def test_vllm_blocks_of_several_duet_blocks_are_split() -> None:
    """vLLM's CPU attention needs 32-token blocks; duet hashes 16: one vLLM block → two hashes,
    announced and removed together, chained across events."""
    tokens = list(range(1000, 1000 + 4 * 32))
    t = HashTranslator(BS)
    out = t.translate(
        [
            VStored(
                block_hashes=[vhash(1)],
                parent_block_hash=None,
                token_ids=tokens[:32],
                block_size=32,
            ),
            VStored(
                block_hashes=[vhash(2), vhash(3)],
                parent_block_hash=vhash(1),
                token_ids=tokens[32:96],
                block_size=32,
            ),
        ]
    )
    want = block_hashes(tokens[:96], BS)
    assert [h for e in out for h in e.block_hashes] == want  # type: ignore[union-attr]
    assert all(isinstance(e, BlockStored) and e.block_size == BS for e in out)
    assert out[1].parent_block_hash == want[1]  # type: ignore[union-attr]
    assert t.translate([VRemoved(block_hashes=[vhash(2)])]) == [
        BlockRemoved(block_hashes=want[2:4])
    ]
    assert sorted(t.cached_hashes()) == sorted(want[:2] + want[4:])


def test_a_salted_prompt_chains_from_its_cache_domain() -> None:
    """vLLM publishes the request's cache_salt in the first block's extra keys; the bridge roots
    the chain at that domain, as the gateway does (the index never matches across
    domains, and still finds a team's own prefixes)."""
    from protocol.block_hash import domain_root

    tokens = list(range(3 * BS))
    wire = msgspec.msgpack.encode(
        VStored(
            block_hashes=[vhash(1), vhash(2), vhash(3)],
            parent_block_hash=None,
            token_ids=tokens,
            block_size=BS,
            extra_keys=[["team:a"], None, None],
        )
    )
    ev = msgspec.msgpack.decode(wire, type=VStored)
    (out,) = HashTranslator(BS).translate([ev])
    assert isinstance(out, BlockStored)
    assert out.block_hashes == block_hashes(tokens, BS, parent=domain_root("team:a"))
    assert out.block_hashes != block_hashes(tokens, BS)
