"""Content digests of KV blocks: what proves a cache hit is the KV it claims to be.

    digest = xxh3_64(DIGEST_SEED, block bytes ‖ chain hash as u64 LE ‖ domain root as u64 LE)

over the whole block as the pool lays it out (`KVLayout.block_bytes`, whatever its dtype: a KV
format that keeps its scales inside the block is covered by the same bytes). The chain hash is
the block's prefix hash (protocol/block_hash.py) — for a prompt's last, partial block the same
function over its partial tokens (`tail_chain_hash`) — and the domain root is the cache
domain's `h_{-1}`. Binding both means a block that holds another prefix's KV, or another
domain's, fails the check even when its bytes are intact: the failure the leaders' users met
as "a disk tier answered with other requests' content".

Who computes and who checks: the engine digests a full block when its KV is written (computed,
or arrived and verified), a prefill node digests its held partial tail when it holds it; the
digest travels with every copy (P → D in `kv_transfer_params`, a peer's share answer, the
spill tiers' entries); the reader recomputes it over the bytes it is about to use, with the
chain hash it derives from its own tokens and domain, and on a mismatch fails closed: the block
is dropped and its tokens recomputed. It lives in protocol/ because both ends of a transfer
must compute it identically, as with the block hash itself.

The digest is computed in two steps so that the expensive one can run where the bytes land:
`hash_bytes` streams a block's bytes into an xxh3 state (a pass over the block: as costly as
copying it), `finish_digest` binds a copy of that state to the chain hash and domain root (a few
nanoseconds). A reader that hashed a block's bytes as they arrived (kvtransfer/hashed_read.py)
hands the states to the engine, which finishes them with the chain hashes it derives itself:
`block_digest` is exactly `finish_digest(hash_bytes(data), ...)`, one format whichever path.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

import xxhash

from protocol.block_hash import DEFAULT_HASH_SEED, hash_block

#: seed of every block digest (a constant of the format: changing it invalidates every digest)
DIGEST_SEED = 0x6B766469  # "kvdi"
_FOOTER = struct.Struct("<QQ")


#: a block's bytes streamed into the digest's hash, not yet bound (`finish_digest` binds it)
BytesHash = xxhash.xxh3_64


def hash_bytes(data: memoryview | bytes) -> BytesHash:
    """The digest's state after one block's bytes: the costly part, done once per block."""
    h = xxhash.xxh3_64(seed=DIGEST_SEED)
    h.update(data)
    return h


def finish_digest(state: BytesHash, chain_hash: int, domain_root: int) -> int:
    """The digest of the bytes `state` has hashed, bound to a chain hash and a domain root.
    `state` is left as it was (a copy is finished), so one state serves any binding."""
    h = state.copy()
    h.update(_FOOTER.pack(chain_hash & (2**64 - 1), domain_root & (2**64 - 1)))
    return h.intdigest()


def block_digest(data: memoryview | bytes, chain_hash: int, domain_root: int) -> int:
    """The digest of one block's bytes, bound to its chain hash and its domain's root."""
    return finish_digest(hash_bytes(data), chain_hash, domain_root)


def tail_chain_hash(parent: int, tokens: Sequence[int], seed: int = DEFAULT_HASH_SEED) -> int:
    """The chain hash a partial (last) block's digest is bound to: the block hash function over
    the tokens it holds, after its parent (the last full block's hash, or the domain root)."""
    return hash_block(parent, tokens, seed)


class KVCheck(enum.Enum):
    """How a transferred or onloaded run of blocks ended, as the engine reports it to the node
    (`kv_ready`): the node counts and logs it, and a decode leg's failure policy reads it."""

    #: the KV is in place and every digest given matched
    READY = "ready"
    #: a digest did not match: the blocks from the first bad one on are recomputed
    MISMATCH = "mismatch"
    #: the caller reported the transfer failed: everything past the local prefix is recomputed
    FAILED = "failed"
    #: the engine knew no such request waiting for KV (aborted, or never reserved)
    UNKNOWN = "unknown"

    def __bool__(self) -> bool:
        """True when the engine knew the request (as `kv_ready`'s bool answer was)."""
        return self is not KVCheck.UNKNOWN
