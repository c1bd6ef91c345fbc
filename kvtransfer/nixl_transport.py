"""NIXL backend (default): one-sided RDMA-style READs of peer blocks, UCX underneath.

Setup: the pool is registered with NIXL once, and a descriptor list with one entry per
block is prepared once locally and once per peer, so a read of N blocks is one
`make_prepped_xfer` + `transfer` (NIXL merges runs of adjacent blocks into one region).
`add_peer` ends with a probe READ of one block into a scratch buffer: UCX's connection
handshake needs the owner to answer, and doing it there (under add_peer's timeout) means a
read never waits for it.
Host pools are "DRAM", CUDA pools "VRAM" (GPUDirect when UCX has it).

Threading: the agent is created without NIXL's progress thread, which busy-polls a whole
core (its delay is fixed at 0) and would starve the engine on a CPU node. Instead the
event loop makes progress: reads poll `check_xfer_state` with short sleeps, and a poller
task calls `get_new_notifs` every `poll_interval` (which also answers peers' connection
handshakes) while the transport is busy, and backs off to `idle_poll_interval` when it is not:
500 wakeups a second cost an idle node ~6 % of a core, and every idle node on a shared machine
pays it. Busy means: for `BUSY_WINDOW_S` after any agent call, a served `/kv/metadata` (a peer
is about to connect and its handshake needs our progress) or a notification, and until the end
of every `expect_reads()` window (a prefill node holding blocks for a lease). All agent calls are
serialised by one lock (the agent runs in NIXL's no-locking mode); small calls run inline on the
loop, a large `transfer()` — which on one host performs the whole kernel copy (UCX `cma`) before
returning, with the GIL released — runs on a dedicated thread so the loop keeps serving.
A read whose caller asks to hear of blocks as they land (`landed`) is posted as a sequence of
transfers under one hold of the lock, each as large as all those after it down to
`LANDED_TAIL_BYTES`, each reported once its transfer is done: the caller hashes one chunk while
the next, half as large, is copied, and what is left to hash after the last copy is small.

Between hosts, UCX needs no progress from the owner for RDMA READs; when only TCP links
the hosts, UCX emulates READ with messages the owner must answer: enable
`progress_thread=True` there (see kvtransfer/README.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from kvtransfer.base import DEFAULT_TIMEOUT, Landed, Peer, Transport
from kvtransfer.errors import BackendUnavailable, PeerError, TransferError
from kvtransfer.memory import PoolMemory, parse_device
from kvtransfer.metadata import Notification, TransportMetadata
from kvtransfer.metrics import KVTransferMetrics
from kvtransfer.regions import ReadPlan, block_descriptors

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Reads up to this size are posted inline on the loop (blocking it ~1 ms at most); larger
#: ones on the agent thread. bench/kvtransfer.py --sweep-ucx: a thread hop cost ~0.2 ms on
#: a loaded 2-core host, 5x a 1-block (360 KiB) copy, and nothing measurable at 256 blocks.
DEFAULT_INLINE_MAX_BYTES = 8 * 1024 * 1024
#: A read whose caller wants blocks reported as they land is posted in tapering transfers
#: (`ReadPlan.tapering`) whose last one is about this large: on one host each is copied when
#: posted, so the caller hashes a chunk while the next is copied, and only the last one is
#: left to hash once the read is over; a post costs tens of microseconds, so a read of n blocks
#: takes about log2(n) of them (python -m bench.kvtransfer).
LANDED_TAIL_BYTES = 256 * 1024
#: after any activity, how long the notification poller keeps its short interval
BUSY_WINDOW_S = 1.0
#: how long a timed-out read waits for its posting thread to stop writing local blocks
_SETTLE_CAP_S = 5.0
#: tries at creating the agent's UCX backend, and the pause before the next (times the attempt)
AGENT_START_ATTEMPTS = 3
AGENT_RETRY_DELAY_S = 0.2


def import_nixl() -> ModuleType:
    """NIXL's Python API module, whichever wheel provides it; else BackendUnavailable."""
    # NIXL logs INFO lines to stdout, configured once at import; an operator can still ask.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    errors = []
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as e:  # missing, or present but its native library fails to load
            errors.append(f"{name}: {e}")
    raise BackendUnavailable("NIXL is not importable (" + "; ".join(errors) + ")")


def _start_agent(api: ModuleType, name: str, config: Any, ucx_params: dict[str, str]) -> Any:
    """A NIXL agent called `name` with its UCX backend (`ucx_params`, a copy the caller made),
    trying `AGENT_START_ATTEMPTS` times.

    Creating the UCX backend opens an endpoint of the agent to itself (NIXL's intra-agent
    transfer setup), and on a crowded host that has failed once in a while ("UCX endpoint
    create failed") where the next try succeeds. A retry of the same backend is not a
    fallback; only when every attempt fails is NIXL unavailable (and strict mode refuses the
    tcp fallback). The agent name doubles as our identity in peers' notification queues.
    """
    errors: list[str] = []
    for attempt in range(1, AGENT_START_ATTEMPTS + 1):
        agent = None
        try:
            agent = api.nixl_agent(name, config)
            agent.create_backend("UCX", ucx_params)
            return agent
        except Exception as e:
            del agent  # the failed agent (and what its backend opened) goes before the next try
            errors.append(f"attempt {attempt}: {e}")
            if attempt < AGENT_START_ATTEMPTS:
                log.warning("NIXL agent %s: UCX backend failed to start (%s); retrying", name, e)
                time.sleep(AGENT_RETRY_DELAY_S * attempt)
    raise BackendUnavailable(
        "cannot start a NIXL agent with UCX after "
        f"{AGENT_START_ATTEMPTS} attempts: " + "; ".join(errors)
    )


def _mem_type(device: str) -> str:
    return "DRAM" if parse_device(device)[0] == "cpu" else "VRAM"


class NixlPeer(Peer):
    def __init__(self, metadata: TransportMetadata, agent_name: str, dlist: Any) -> None:
        super().__init__(metadata)
        self.agent_name = agent_name
        self.dlist = dlist  # prepared descriptor list of the peer's pool, one row per block


class NixlTransport(Transport):
    backend = "nixl"

    def __init__(
        self,
        *,
        engine_id: str,
        metrics: KVTransferMetrics | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        hugepages: bool = True,
        progress_thread: bool = False,
        poll_interval: float = 0.002,
        idle_poll_interval: float = 0.05,
        inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES,
        ucx_params: dict[str, str] | None = None,
    ) -> None:
        super().__init__(engine_id=engine_id, metrics=metrics, timeout=timeout, hugepages=hugepages)
        api = import_nixl()
        self._poll_interval = poll_interval
        self._idle_poll_interval = max(idle_poll_interval, poll_interval)
        #: monotonic time until which the poller keeps `poll_interval` (see the module docstring)
        self._busy_until = time.monotonic() + BUSY_WINDOW_S
        self._inline_max_bytes = inline_max_bytes
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-nixl")
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        try:
            self._agent = _start_agent(api, engine_id, config, dict(ucx_params or {}))
        except BackendUnavailable:
            self._executor.shutdown(wait=False)
            raise
        self._reg_descs: Any = None
        self._local_dlist: Any = None
        # Destination of add_peer()'s probe READ (one block); never part of the pool.
        self._scratch: np.ndarray | None = None
        self._scratch_descs: Any = None
        self._scratch_dlist: Any = None
        self._agent_md = b""
        self._poller: asyncio.Task[None] | None = None

    # -- agent access ----------------------------------------------------------------

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return fn(*args)

    def expect_reads(self, seconds: float) -> None:
        self._busy(seconds)

    def _busy(self, seconds: float = 0.0) -> None:
        self._busy_until = max(self._busy_until, time.monotonic() + max(seconds, BUSY_WINDOW_S))

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a (short) agent call inline when the agent is free, else on its thread."""
        self._busy()
        if self._lock.acquire(blocking=False):
            try:
                return fn(*args)
            finally:
                self._lock.release()
        return await asyncio.wrap_future(self._executor.submit(self._locked, fn, *args))

    # -- registration ----------------------------------------------------------------

    async def _register(self, pool: PoolMemory) -> None:
        mem = _mem_type(pool.device)
        dev = pool.device_index
        try:
            self._reg_descs = await self._call(
                self._agent.register_memory, [(pool.base, pool.nbytes, dev, "")], mem
            )
            rows = block_descriptors(pool.base, pool.layout, dev)
            self._local_dlist = await self._call(
                self._agent.prep_xfer_dlist, "NIXL_INIT_AGENT", rows, mem
            )
            bb = pool.layout.block_bytes
            self._scratch = np.zeros(bb, dtype=np.uint8)
            scratch = [(self._scratch.ctypes.data, bb, 0)]
            self._scratch_descs = await self._call(
                self._agent.register_memory, [(*scratch[0], "")], "DRAM"
            )
            self._scratch_dlist = await self._call(
                self._agent.prep_xfer_dlist, "NIXL_INIT_AGENT", scratch, "DRAM"
            )
            self._agent_md = await self._call(self._agent.get_agent_metadata)
        except Exception as e:
            raise TransferError(f"NIXL could not register the KV pool: {e}") from e
        self._poller = asyncio.get_running_loop().create_task(
            self._poll_notifications(), name=f"kvtransfer-nixl-poll-{self.engine_id}"
        )

    def _metadata_fields(self) -> dict[str, Any]:
        self._busy()  # served to a peer that is about to connect: answer its handshake promptly
        return {"agent_metadata": self._agent_md}

    async def _poll_notifications(self) -> None:
        # Also the owner's only source of UCX progress when the progress thread is off:
        # peers' connection handshakes are answered from here.
        interval = self._poll_interval
        while True:
            await asyncio.sleep(interval)
            # fast while busy; idle, the interval doubles up to idle_poll_interval
            busy = time.monotonic() < self._busy_until
            interval = self._poll_interval if busy else min(interval * 2, self._idle_poll_interval)
            if not self._lock.acquire(blocking=False):
                continue  # a transfer holds the agent; it progresses the worker meanwhile
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:
                log.exception("NIXL notification poll failed")
                continue
            finally:
                self._lock.release()
            if notifs:
                self._busy()
                interval = self._poll_interval
            for name, messages in notifs.items():
                for m in messages:
                    self._deliver(Notification(engine_id=name, message=bytes(m)))

    # -- peers -----------------------------------------------------------------------

    async def _connect(self, metadata: TransportMetadata) -> Peer:
        try:
            name = await self._call(self._agent.add_remote_agent, metadata.agent_metadata)
        except Exception as e:
            raise PeerError(
                f"NIXL rejected the metadata of peer {metadata.engine_id!r}: {e}"
            ) from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            if name != metadata.engine_id:
                raise PeerError(
                    f"peer {metadata.engine_id!r} published a NIXL agent named {name!r}"
                )
            rows = block_descriptors(
                metadata.base_address, metadata.layout, parse_device(metadata.device)[1]
            )
            try:
                dlist = await self._call(
                    self._agent.prep_xfer_dlist, name, rows, _mem_type(metadata.device)
                )
            except Exception as e:  # NIXL checks rows against the memory the peer registered
                raise PeerError(
                    f"the metadata of peer {metadata.engine_id!r} describes blocks outside the "
                    f"memory it registered (stale or inconsistent metadata): {e}"
                ) from e
            peer = NixlPeer(metadata, name, dlist)
            await self._probe(peer)
        except BaseException:
            await self._forget_agent(name)
            raise
        return peer

    async def _probe(self, peer: NixlPeer) -> None:
        """READ the peer's block 0 into a scratch block, through the same prepared lists as
        `read`: UCX completes its connection handshake (which needs the owner to answer)
        here, under add_peer's timeout, and a peer we cannot read fails now, not mid-request."""
        handle = await self._call(
            self._agent.make_prepped_xfer, "READ", self._scratch_dlist, [0], peer.dlist, [0]
        )
        try:
            state = await self._call(self._agent.transfer, handle)
            await self._wait(handle, state, peer.engine_id)
        finally:
            await self._release(handle)

    async def _forget_agent(self, name: str) -> None:
        try:
            await self._call(self._agent.remove_remote_agent, name)
        except Exception as e:
            log.debug("removing NIXL agent %r: %s", name, e)

    async def _disconnect(self, peer: Peer) -> None:
        assert isinstance(peer, NixlPeer)
        try:
            await self._call(peer.dlist.release)
        except Exception as e:
            log.debug("releasing descriptors of %r: %s", peer.engine_id, e)
        await self._forget_agent(peer.agent_name)

    # -- data ------------------------------------------------------------------------

    def _post(self, peer: NixlPeer, plan: ReadPlan, notif: bytes) -> tuple[Any, str]:
        handle = self._agent.make_prepped_xfer(
            "READ",
            self._local_dlist,
            np.asarray(plan.local_ids, dtype=np.int32),
            peer.dlist,
            np.asarray(plan.remote_ids, dtype=np.int32),
            notif,
        )
        try:
            return handle, self._agent.transfer(handle)
        except BaseException:
            handle.release()
            raise

    async def _release(self, handle: Any) -> None:
        try:
            await self._call(handle.release)
        except Exception as e:  # NIXL could not cancel an active transfer
            log.warning("NIXL transfer handle not released: %s", e)

    def _post_landing(
        self, peer: NixlPeer, plan: ReadPlan, landed: Landed | None, chunked: bool
    ) -> tuple[Any, str, ReadPlan, ReadPlan | None]:
        """Post `plan`; with `landed` and `chunked`, in tapering chunks (`LANDED_TAIL_BYTES`),
        reporting each chunk that its post completed (one host: `transfer` is the copy) and
        going on with the next.
        Returns the handle and state of the last transfer posted, the part of `plan` it moves
        (reported only once it is done), and what is left unposted: everything after a chunk that
        is still in flight when posted (a one-sided READ across hosts, which completes later:
        chunking gains nothing there, so the caller posts the rest whole)."""
        if landed is None or not chunked:
            return (*self._post(peer, plan, b""), plan, None)
        chunks = plan.tapering(LANDED_TAIL_BYTES // plan.block_bytes)
        for i, chunk in enumerate(chunks):
            handle, state = self._post(peer, chunk, b"")
            if state != "DONE" or i == len(chunks) - 1:
                rest = plan.part(sum(c.num_blocks for c in chunks[: i + 1]))
                return handle, state, chunk, rest if rest.num_blocks else None
            try:
                handle.release()
            except Exception as e:  # a finished transfer: nothing can still write its blocks
                log.warning("NIXL transfer handle not released: %s", e)
            landed(chunk.local_ids)
        raise AssertionError("unreachable: a plan has at least one chunk")

    async def _read(self, peer: Peer, plan: ReadPlan, landed: Landed | None) -> None:
        assert isinstance(peer, NixlPeer)
        todo: ReadPlan | None = plan
        chunked = True
        while todo is not None:
            todo, in_flight = await self._read_part(peer, todo, plan, landed, chunked)
            chunked = chunked and not in_flight  # one-sided and asynchronous: the rest whole

    async def _read_part(
        self,
        peer: NixlPeer,
        part: ReadPlan,
        whole: ReadPlan,
        landed: Landed | None,
        chunked: bool,
    ) -> tuple[ReadPlan | None, bool]:
        """Post `part` of the read `whole` and wait for it (see `_post_landing`). Returns what is
        left to post and whether a transfer was still in flight when posted."""
        if part.nbytes <= self._inline_max_bytes and self._lock.acquire(blocking=False):
            try:
                handle, state, last, rest = self._post_landing(peer, part, landed, chunked)
            finally:
                self._lock.release()
        else:
            future = self._executor.submit(
                self._locked, self._post_landing, peer, part, landed, chunked
            )
            try:
                handle, state, last, rest = await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                # The copy may still be writing our blocks on the agent thread. A caller that
                # reuses those blocks after the error (a decode node recomputing) must not race
                # it, so wait for it to stop: on one host it is a bounded local copy, across
                # hosts posting returns at once. Only a thread stuck past the cap is abandoned
                # (its handle is then released when it returns).
                with contextlib.suppress(BaseException):
                    async with asyncio.timeout(_SETTLE_CAP_S):
                        await asyncio.shield(asyncio.wrap_future(future))
                if not future.done():
                    log.warning(
                        "a timed-out NIXL read is still copying after %.0f s", _SETTLE_CAP_S
                    )
                    # The caller quarantines the blocks until the copy is over.
                    self._late_write(whole, asyncio.ensure_future(self._settle_posting(future)))
                else:
                    future.add_done_callback(self._release_abandoned)
                raise
        in_flight = state == "PROC"
        try:
            await self._wait(handle, state, peer.engine_id)
        except asyncio.CancelledError:
            # Timed out (or the caller gave up) while the transfer may still be in flight: it can
            # still write our blocks, so they stay quarantined until NIXL says it is over.
            self._late_write(whole, asyncio.ensure_future(self._settle(handle)))
            raise
        except BaseException:
            await self._release(handle)
            raise
        await self._release(handle)
        if landed is not None:
            landed(last.local_ids)
        return rest, in_flight

    async def _settle(self, handle: Any) -> None:
        """Wait until a transfer we gave up on is no longer in flight, then free its handle."""
        delay = 1e-3
        with contextlib.suppress(Exception):
            while await self._call(self._agent.check_xfer_state, handle) == "PROC":
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.1)
        await self._release(handle)

    async def _settle_posting(self, future: concurrent.futures.Future[Any]) -> None:
        """The posting thread of an abandoned read: wait for it, then for its transfer."""
        with contextlib.suppress(BaseException):
            posted = await asyncio.wrap_future(future)
            await self._settle(posted[0])

    async def _wait(self, handle: Any, state: str, engine_id: str) -> None:
        delay = 0.0
        while state == "PROC":
            # sleep(0) first: on one host the copy is done by now; across hosts the wait
            # backs off to 1 ms so a long transfer does not spin the loop.
            await asyncio.sleep(delay)
            delay = min(max(delay * 2, 50e-6), 1e-3)
            state = await self._call(self._agent.check_xfer_state, handle)
        if state != "DONE":
            raise PeerError(f"NIXL READ from peer {engine_id!r} failed ({state})")

    def _release_abandoned(self, future: concurrent.futures.Future[Any]) -> None:
        # Runs on the agent thread once it let go of the lock (or here, if already done).
        if future.cancelled() or future.exception() is not None:
            return
        try:
            self._locked(future.result()[0].release)
        except Exception as e:
            log.warning("NIXL transfer handle not released: %s", e)

    async def _notify(self, peer: Peer, message: bytes) -> None:
        assert isinstance(peer, NixlPeer)
        try:
            await self._call(self._agent.send_notif, peer.agent_name, message)
        except Exception as e:
            raise PeerError(f"NIXL notification to {peer.engine_id!r} failed: {e}") from e

    # -- lifecycle -------------------------------------------------------------------

    async def _close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        try:
            for dlist in (self._local_dlist, self._scratch_dlist):
                if dlist is not None:
                    await self._call(dlist.release)
            for descs in (self._reg_descs, self._scratch_descs):
                if descs is not None:
                    await self._call(self._agent.deregister_memory, descs)
        except Exception as e:
            log.debug("NIXL cleanup: %s", e)
        self._executor.shutdown(wait=True)
