"""Block hashes are a cross-process contract: pin known values so a change cannot slip by."""

import struct

import xxhash
from hypothesis import given
from hypothesis import strategies as st

from protocol.block_hash import DEFAULT_HASH_SEED, ROOT_PARENT_HASH, block_hashes, hash_block


def test_pinned_values() -> None:
    assert block_hashes(list(range(32))) == [3730515634741471027, 4941937999177233775]
    assert block_hashes([1] * 16) == [17151814788377729146]


def test_definition_matches_design() -> None:
    toks = list(range(100, 116))
    expected = xxhash.xxh3_64_intdigest(
        struct.pack("<Q", ROOT_PARENT_HASH) + struct.pack("<16I", *toks), seed=DEFAULT_HASH_SEED
    )
    assert hash_block(ROOT_PARENT_HASH, toks) == expected


def test_partial_block_has_no_hash() -> None:
    assert block_hashes(list(range(15))) == []
    assert len(block_hashes(list(range(47)))) == 2


@given(st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=80), st.integers(0, 2**32 - 1))
def test_chained_prefix_property(tokens: list[int], other: int) -> None:
    hs = block_hashes(tokens)
    # A prefix's hashes are a prefix of the hashes.
    assert block_hashes(tokens[:16]) == hs[:1]
    # Changing a token in block 0 changes every later hash (the chain carries it).
    changed = [other if other != tokens[0] else other ^ 1, *tokens[1:]]
    assert all(a != b for a, b in zip(block_hashes(changed), hs, strict=True))


def test_seed_changes_hashes() -> None:
    assert block_hashes(list(range(16)), seed=1) != block_hashes(list(range(16)))


def test_a_cache_domain_salts_the_whole_chain() -> None:
    """DESIGN §8: h_{-1} = xxh3_64(seed, domain); no domain is the unsalted root."""
    from protocol.block_hash import domain_root

    toks = list(range(48))
    assert domain_root(None) == domain_root("") == ROOT_PARENT_HASH
    assert domain_root("team:a") == xxhash.xxh3_64_intdigest(b"team:a", seed=DEFAULT_HASH_SEED)
    a, b = (block_hashes(toks, 16, parent=domain_root(d)) for d in ("team:a", "team:b"))
    assert not set(a) & set(b) and not set(a) & set(block_hashes(toks, 16))
    assert a == block_hashes(toks, 16, parent=domain_root("team:a"))


def test_a_lora_adapter_is_part_of_the_root() -> None:
    """An adapter's KV is not the base model's: its chain starts from the domain's root mixed
    with the adapter's name; no adapter leaves the domain's root as it was."""
    import struct

    from protocol.block_hash import domain_root

    toks = list(range(48))
    assert domain_root("team:a", adapter=None) == domain_root("team:a", adapter="")
    mixed = struct.pack("<Q", domain_root("team:a")) + b"lora:sql"
    assert domain_root("team:a", adapter="sql") == xxhash.xxh3_64_intdigest(
        mixed, seed=DEFAULT_HASH_SEED
    )
    roots = {domain_root(d, adapter=a) for d in (None, "team:a") for a in (None, "sql", "chat")}
    assert len(roots) == 6
    sql, base = (block_hashes(toks, 16, parent=domain_root(None, adapter=a)) for a in ("sql", None))
    assert not set(sql) & set(base)
