"""Reads whose blocks are hashed as they land: the digest check off the read's critical path.

A reader must check the blocks it read against the sender's content digests before it uses
them (protocol/kv_digest.py). Hashing them after the read, on the thread that waits for the
read, costs one more pass over every byte: on one host, where the read is itself a CPU copy,
about half of the read's time again, and on the engine's thread it delays every running
request's step. `read_hashed` asks the transport to report blocks as their bytes land
(`Transport.read(landed=...)`: per chunk of a NIXL read, per run of a tcp stream) and hashes
each chunk on a worker thread while the next one moves, so the caller waits only for the last
chunk's hash, of bytes still in the CPU's cache. That needs a core to spare: on a host without
one the worker only competes with the copy (on two shared cores it measured slower than hashing
after the read), so there the blocks are hashed once the read is over, by the caller or, for a
large read, the worker. Either way the engine's thread no longer hashes: `read_hashed` returns
the hash state of every block's bytes (`hash_bytes`), which the engine binds to the chain hashes
it derives itself and compares with the sender's digests (engine/kv_moves.py `verify`): what is
checked is unchanged, only where and when the bytes are hashed.

Invariants: a block is hashed only after the transport reported its bytes final, and nothing
writes it afterwards (its request waits for its KV; the engine never hands the block out
meanwhile), so its state is the hash of the bytes the engine will use. A failed read raises the
transport's own error (its `settled` included) once every hash already started is over, so no
worker reads a block after the caller got its answer. A device pool has no host view to hash:
the read is plain and no state is returned (the engine then hashes the blocks itself).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Sequence

from kvtransfer.base import Peer, Transport
from protocol.kv_digest import BytesHash, hash_bytes

#: Fewest bytes per hashing job: landed blocks are gathered up to this before a job starts (a tcp
#: read reports every run of blocks, often one block); NIXL's chunks are at least as large
#: (LANDED_TAIL_BYTES), so each is one job, and the last job is small: the caller's wait.
HASH_JOB_BYTES = 256 * 1024
#: Without overlap, a read up to this size is hashed on the caller's thread once it is over
#: (under a millisecond, the bound NIXL keeps for posting inline on the loop); a larger one on
#: the hashing thread, so the loop keeps serving.
INLINE_HASH_BYTES = 8 * 1024 * 1024
#: CPUs this process may use from which hashing beside the copy is the default: one for the
#: copy, one for the hashing, one for the engine.
OVERLAP_MIN_CPUS = 3
#: environment variable that forces the default either way: "1" overlap, "0" after the read
OVERLAP_ENV = "DUET_KV_HASH_OVERLAP"

# One thread for every reader of the process: one pass over the bytes, on one core beside the
# copy, whatever the number of reads at once.
_HASHER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-digest")


def _hash_blocks(view: memoryview, block_bytes: int, ids: Sequence[int]) -> list[BytesHash]:
    return [hash_bytes(view[b * block_bytes : (b + 1) * block_bytes]) for b in ids]


class _Hashing:
    """The `landed` callback: gathers landed blocks into jobs for the hashing thread. Called
    from the loop or from a transport's posting thread, one call at a time."""

    def __init__(self, view: memoryview, block_bytes: int, job_bytes: int) -> None:
        self.view, self.block_bytes = view, block_bytes
        self.per_job = max(1, job_bytes // block_bytes)
        self.pending: list[int] = []
        self.jobs: list[tuple[list[int], concurrent.futures.Future[list[BytesHash]]]] = []
        self._lock = threading.Lock()

    def __call__(self, ids: Sequence[int]) -> None:
        with self._lock:
            self.pending.extend(ids)
            if len(self.pending) >= self.per_job:
                self._submit()

    def _submit(self) -> None:
        ids, self.pending = self.pending, []
        if ids:
            self.jobs.append((ids, _HASHER.submit(_hash_blocks, self.view, self.block_bytes, ids)))

    def flush(self) -> list[concurrent.futures.Future[list[BytesHash]]]:
        with self._lock:
            self._submit()
            return [f for _, f in self.jobs]

    async def states(self) -> dict[int, BytesHash]:
        """Every job's states; a job the hashing thread has not started is done here, from the
        last one back (the thread takes them from the first): on a busy host that thread may
        wait milliseconds for a core, and this one is running now."""
        self.flush()
        out: dict[int, BytesHash] = {}
        started = []
        for ids, job in reversed(self.jobs):
            if job.cancel():
                out.update(zip(ids, _hash_blocks(self.view, self.block_bytes, ids), strict=True))
            else:
                started.append((ids, job))
        for ids, job in started:
            states: list[BytesHash] = await asyncio.wrap_future(job)
            out.update(zip(ids, states, strict=True))
        return out


def spare_core() -> bool:
    """Whether to hash beside the copy by default: `DUET_KV_HASH_OVERLAP` 1 or 0 when set, else
    whether this process may run on a core beyond the copy's and the engine's (on two cores
    hashing beside the copy measured slower than after the read, docs/benchmarks.md)."""
    forced = os.environ.get(OVERLAP_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    cpus = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    return cpus >= OVERLAP_MIN_CPUS


async def read_hashed(
    transport: Transport,
    peer: Peer | str,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    *,
    timeout: float | None = None,
    overlap: bool | None = None,
    job_bytes: int = HASH_JOB_BYTES,
) -> dict[int, BytesHash]:
    """`transport.read` of the same blocks (same errors and timeout), and the hash state of
    each local block's bytes as read, by local block id ({} for a device pool). `overlap`:
    hash while the read moves (default: where there is a spare core, `spare_core`); else the
    blocks are hashed once the read is over, here when they are few (as NIXL posts a small read
    inline), on the hashing thread when they are many."""
    pool = transport.pool
    if pool.is_cuda:
        await transport.read(peer, remote_block_ids, local_block_ids, timeout=timeout)
        return {}
    view, bb = pool.host_view(), pool.layout.block_bytes
    if not (spare_core() if overlap is None else overlap):
        await transport.read(peer, remote_block_ids, local_block_ids, timeout=timeout)
        local = list(local_block_ids)
        if len(local) * bb <= INLINE_HASH_BYTES:
            return dict(zip(local, _hash_blocks(view, bb, local), strict=True))
        states: list[BytesHash] = await asyncio.wrap_future(
            _HASHER.submit(_hash_blocks, view, bb, local)
        )
        return dict(zip(local, states, strict=True))
    hashing = _Hashing(view, bb, job_bytes)
    try:
        await transport.read(
            peer, remote_block_ids, local_block_ids, timeout=timeout, landed=hashing
        )
    except BaseException:
        # The hashing thread reads the blocks: let it finish before the caller may free them.
        jobs = [asyncio.wrap_future(f) for f in hashing.flush()]
        await asyncio.shield(asyncio.gather(*jobs, return_exceptions=True))
        raise
    return await hashing.states()
