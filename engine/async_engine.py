"""AsyncEngine: the engine on a dedicated thread, driven from an asyncio event loop.

The node servers sit on this. Coroutines submit commands (add, abort, release, kv_ready);
the engine thread runs them between steps, so EngineCore stays single-threaded. After each
step the thread hands the step's deltas to the loop in one `call_soon_threadsafe`, which
routes them to per-request streams.

Invariants: every stream ends (finished delta, or an exception if the engine died); a command
raises in the caller exactly what it raised on the engine thread; no torch work happens on the
event loop thread (torch releases the GIL, so HTTP stays responsive while a step runs). The
thread never spins: when a step changed nothing (requests wait but none can be admitted, the
pool pinned by held or reserved blocks) it sleeps until a command arrives or the next hold
expires. If the thread dies, `on_dead` is called on the loop: the owner must restart the
engine or exit, never stay half alive.

The thread also times itself (`StepTiming`): wall and CPU seconds inside `EngineCore.step`, and
the wall seconds between two steps while it had work (commands, publishing, waiting for the GIL
the loop holds). Offline step profiles time the step alone; these say what a step costs inside
a running node, and what the node adds between steps (`duet bench profile --overheads`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.embed import Pooling
from engine.holds import Claim
from engine.lora import LoraError, read_adapter
from engine.outputs import RequestOutput
from engine.request import Priority, Request
from engine.sampling_params import SamplingParams
from engine.sleep import SleepReport
from protocol.kv_digest import BytesHash, KVCheck

log = logging.getLogger("duet.engine")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread failed; the node should report unhealthy."""


@dataclass
class RequestStream:
    """Deltas of one request; iterate with `async for`. For a request whose KV comes from a
    remote prefill node, `reserved` resolves to its local block ids first."""

    request_id: str
    prompt_token_ids: list[int]
    reserved: asyncio.Future[list[int]] | None = None
    num_cached_blocks: int = 0  # local prefix-cache hit at reservation (remote requests)
    _queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            yield item


@dataclass
class _EmbedJob:
    prompts: list[list[int]]
    pooling: Pooling
    dimensions: int | None
    fut: asyncio.Future[list[bytes]]
    loop: asyncio.AbstractEventLoop
    #: called on the engine thread with the job's tokens when it is answered
    done: Callable[[int], None]

    @property
    def tokens(self) -> int:
        return sum(map(len, self.prompts))


@dataclass
class StepTiming:
    """Accounts of the engine thread, written by it alone and published with the stats.

    `gap_s` counts only gaps after a step that left work to do (the thread went straight back
    to stepping), never idle sleeps: it is the time the node's own work put between steps."""

    steps: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    #: the same over steps that computed no prompt token (pure decode: what sets ITL)
    decode_steps: int = 0
    decode_wall_s: float = 0.0
    decode_cpu_s: float = 0.0
    gap_s: float = 0.0
    gaps: int = 0
    #: perf_counter at the end of the last step, if that step left runnable work; else None
    busy_since: float | None = None

    def stats(self) -> dict[str, float]:
        return {
            "engine_steps": self.steps,
            "engine_step_seconds": self.wall_s,
            "engine_step_cpu_seconds": self.cpu_s,
            "engine_step_gap_seconds": self.gap_s,
            "engine_step_gaps": self.gaps,
            "engine_decode_steps": self.decode_steps,
            "engine_decode_step_seconds": self.decode_wall_s,
            "engine_decode_step_cpu_seconds": self.decode_cpu_s,
        }


class AsyncEngine:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None) -> None:
        self.core = core or EngineCore(config)
        self.config = config
        #: commands for the engine thread, run for their effect (a result is dropped); None: stop
        self._commands: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        #: futures of submitted commands not yet answered (failed if the engine dies first)
        self._pending: set[asyncio.Future[Any]] = set()
        #: embedding jobs not yet run (appended on the loop, taken on the engine thread)
        self._embed_jobs: deque[_EmbedJob] = deque()
        #: prompt tokens of embedding jobs submitted (written on the loop) and answered (written
        #: on the engine thread): one writer each, so their difference is safe to read anywhere
        self._embed_tokens_in = 0
        self._embed_tokens_out = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None
        self._on_dead: Callable[[BaseException], None] | None = None
        self.timing = StepTiming()
        self._stats: dict[str, float] = {**self.core.stats(), **self.timing.stats()}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, on_dead: Callable[[BaseException], None] | None = None) -> None:
        self._on_dead = on_dead
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="duet-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.core.guides.close()

    # -- engine thread ---------------------------------------------------------------------
    @property
    def thread_id(self) -> int | None:
        """Native id of the engine thread (for per-thread CPU accounting)."""
        return None if self._thread is None else self._thread.native_id

    def _wait_command(self) -> Callable[[], object] | None:
        """Sleep until a command arrives or the core's next deadline passes (then a no-op)."""
        deadline = self.core.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return self._commands.get(timeout=timeout)
        except queue.Empty:
            return _noop

    def _run(self) -> None:
        core = self.core
        try:
            while True:
                # Idle, or stuck (nothing admissible): sleep until something can change.
                if not core.has_work() or not core.progressed:
                    cmd = self._wait_command()
                    if cmd is None:
                        return
                    cmd()
                while True:  # then run whatever else is queued, without blocking
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if cmd is None:
                        return
                    cmd()
                tm = self.timing
                prompt0 = core.counters.prompt_tokens_computed
                t0, c0 = time.perf_counter(), time.thread_time()
                if tm.busy_since is not None:
                    tm.gap_s += t0 - tm.busy_since
                    tm.gaps += 1
                outputs, reserved = core.step()
                t1, c1 = time.perf_counter(), time.thread_time()
                tm.steps += 1
                tm.wall_s += t1 - t0
                tm.cpu_s += c1 - c0
                if outputs and core.counters.prompt_tokens_computed == prompt0:
                    tm.decode_steps += 1
                    tm.decode_wall_s += t1 - t0
                    tm.decode_cpu_s += c1 - c0
                tm.busy_since = t1 if core.has_work() and core.progressed else None
                self._publish()
                if outputs or reserved:
                    res = [
                        (
                            r.request_id,
                            list(r.block_ids),
                            r.num_cached_tokens // core.pool.block_size,
                        )
                        for r in reserved
                    ]
                    self._call(self._deliver, outputs, res)
        except BaseException as e:  # the thread must not die silently
            log.exception("engine thread failed")
            self.dead = e
            self._call(self._fail_all, e)
            if self._on_dead is not None:
                self._call(self._on_dead, e)

    def _publish(self) -> None:
        """Publish the counters stats() returns (engine thread only; by reference, so readers
        see a whole snapshot)."""
        self._stats = {**self.core.stats(), **self.timing.stats()}

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(fn, *args)

    # -- event loop side -------------------------------------------------------------------
    def _deliver(
        self, outputs: list[RequestOutput], reserved: list[tuple[str, list[int], int]]
    ) -> None:
        for rid, blocks, cached in reserved:
            s = self._streams.get(rid)
            if s is not None and s.reserved is not None and not s.reserved.done():
                s.num_cached_blocks = cached
                s.reserved.set_result(blocks)
        for o in outputs:
            s = self._streams.get(o.request_id)
            if s is None:
                continue
            s._queue.put_nowait(o)
            if o.finished:
                del self._streams[o.request_id]
                if s.reserved is not None and not s.reserved.done():
                    s.reserved.cancel()  # finished (aborted) before its blocks were reserved

    def _fail_all(self, exc: BaseException) -> None:
        err = EngineDeadError(f"engine failed: {exc!r}")
        for s in self._streams.values():
            if s.reserved is not None and not s.reserved.done():
                s.reserved.set_exception(err)
            s._queue.put_nowait(err)
        self._streams.clear()
        # Commands queued but never run (the thread died first) would otherwise wait forever.
        for fut in list(self._pending):
            _set_exception(fut, err)
        self._pending.clear()

    async def _submit(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between steps; return or raise its result here."""
        if self.dead is not None:
            raise EngineDeadError(f"engine failed: {self.dead!r}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        return await fut

    # -- public API ------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        hold_blocks: bool = False,
        remote_num_tokens: int = 0,
        hold_seconds: float | None = None,
    ) -> RequestStream:
        """Queue a request; raises RequestError for a request the engine refuses and
        EngineOverloaded when its queue is full."""
        stream = RequestStream(request_id, [])
        if remote_num_tokens:
            stream.reserved = asyncio.get_running_loop().create_future()
        # Registered before the add runs so no delta can arrive unrouted.
        if request_id in self._streams:
            from engine.core import RequestError

            raise RequestError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = stream
        try:
            if params.guide is not None:  # compiled (or found cached) off the engine thread
                await self._compile(params)

            def add() -> Request:
                added = self.core.add_request(
                    request_id,
                    prompt,
                    params,
                    priority,
                    hold_blocks,
                    remote_num_tokens,
                    hold_seconds,
                )
                # Republished before the caller learns the request was taken: a node acks a route in
                # its next load frame (node/kv_events.py `took`), and the coordinator then stops
                # counting its own reservation (coordinator/nodes.py). Counters as of the last step
                # would miss the request for up to a step — 0.7-1.4 s for a long prompt's chunk on
                # one CPU thread — and routing would send the next requests to a node that
                # looked idle.
                self._publish()
                return added

            req: Request = await self._submit(add)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        stream.prompt_token_ids = req.prompt_token_ids
        return stream

    async def _compile(self, params: SamplingParams) -> None:
        from engine.core import RequestError
        from engine.guided import GuideError

        assert params.guide is not None
        try:
            await asyncio.wrap_future(
                self.core.guides.compile_async(params.guide, params.cache_salt)
            )
        except GuideError as e:
            raise RequestError(str(e)) from None

    async def abort(self, request_id: str) -> bool:
        """Abort a live request, or free the blocks held for a finished one; False if
        neither existed."""

        def run() -> tuple[RequestOutput | None, bool]:
            held = request_id in self.core.scheduler.held
            return self.core.abort(request_id), held

        out, held = await self._submit(run)
        if out is not None:
            self._deliver([out], [])
        return out is not None or held

    async def release(self, request_id: str) -> bool:
        return await self._submit(lambda: self.core.release(request_id))

    async def release_held(self, request_id: str, block_ids: list[int] | None = None) -> int | None:
        """Free a held prefill's blocks if `block_ids` (when given) are exactly them. Answers at
        once, without waiting for the current step (engine/holds.py): the claim is decided here
        and the blocks are freed by a command at the next step boundary. Returns the number of
        blocks, None if nothing is held; raises RequestError when the ids are not its own."""
        if self.dead is not None:
            raise EngineDeadError(f"engine failed: {self.dead!r}")
        outcome, n = self.core.scheduler.ledger.claim(request_id, block_ids, time.monotonic())
        if outcome is Claim.NOT_HELD:
            return None
        if outcome is Claim.NOT_THEIRS:
            from engine.core import RequestError

            raise RequestError(f"block ids {block_ids} do not belong to request {request_id!r}")
        self._commands.put(lambda: self.core.release(request_id))
        return n

    async def kv_ready(
        self,
        request_id: str,
        ok: bool,
        quarantine: bool = False,
        digests: list[int | None] | None = None,
        where: str = "transfer",
        hashed: Mapping[int, BytesHash] | None = None,
    ) -> KVCheck:
        return await self._submit(
            lambda: self.core.kv_ready(request_id, ok, quarantine, digests, where, hashed)
        )

    async def share(
        self, share_id: str, hashes: list[int], cache_salt: str | None, lease_s: float
    ) -> tuple[list[int], list[int]]:
        return await self._submit(lambda: self.core.share(share_id, hashes, cache_salt, lease_s))

    async def release_share(self, share_id: str, block_ids: list[int] | None = None) -> int | None:
        """Free a share's blocks (the peer is done), answered at once as `release_held` is.
        None when nothing is shared under that id; RequestError when the ids are not its own."""
        if self.dead is not None:
            raise EngineDeadError(f"engine failed: {self.dead!r}")
        outcome, n = self.core.scheduler.ledger.claim(share_id, block_ids, time.monotonic())
        if outcome is Claim.NOT_HELD:
            return None
        if outcome is Claim.NOT_THEIRS:
            from engine.core import RequestError

            raise RequestError(f"block ids {block_ids} are not those of share {share_id!r}")
        self._commands.put(lambda: self.core.release_share(share_id))
        return n

    async def release_quarantine(self, request_id: str) -> int:
        return await self._submit(lambda: self.core.release_quarantine(request_id))

    async def embed(
        self, prompts: list[list[int]], pooling: Pooling, dimensions: int | None = None
    ) -> list[bytes]:
        """Embeddings of token-id prompts (EngineCore.embed): each vector's float32 bytes, in
        order. Batched across callers: every job queued while a forward runs goes into the
        next forwards together (`_run_embeds`); a job that fails fails alone."""
        if self.dead is not None:
            raise EngineDeadError(f"engine failed: {self.dead!r}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[bytes]] = loop.create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        self._embed_tokens_in += sum(map(len, prompts))
        self._embed_jobs.append(
            _EmbedJob(prompts, pooling, dimensions, fut, loop, self._embed_answered)
        )
        self._commands.put(self._run_embeds)
        return await fut

    def _run_embeds(self) -> None:
        """On the engine thread: every queued embedding job, jobs of one (pooling, dimensions)
        in one call (their prompts packed into shared forwards). The first of the commands
        queued for them runs them all; the others find nothing left."""
        jobs: list[_EmbedJob] = []
        while self._embed_jobs:
            jobs.append(self._embed_jobs.popleft())
        groups: dict[tuple[Pooling, int | None], list[_EmbedJob]] = {}
        for j in jobs:
            if j.fut.cancelled():
                self._embed_tokens_out += j.tokens
            else:
                groups.setdefault((j.pooling, j.dimensions), []).append(j)
        self._embed_groups(groups)

    def _embed_answered(self, tokens: int) -> None:
        self._embed_tokens_out += tokens  # engine thread only

    @property
    def queued_embed_tokens(self) -> int:
        """Prompt tokens of embedding jobs submitted and not yet answered (load reports)."""
        return max(0, self._embed_tokens_in - self._embed_tokens_out)

    def _embed_groups(self, groups: dict[tuple[Pooling, int | None], list[_EmbedJob]]) -> None:
        for (pooling, dims), group in groups.items():
            try:
                vecs = self.core.embed([p for j in group for p in j.prompts], pooling, dims)
            except Exception as e:
                if len(group) == 1:
                    _answer(group[0], e)
                    continue
                for (
                    j
                ) in group:  # after a failure only: each job on its own, so the culprit fails alone
                    try:
                        _answer(j, self.core.embed(j.prompts, pooling, dims))
                    except Exception as e1:
                        _answer(j, e1)
                continue
            at = 0
            for j in group:
                _answer(j, vecs[at : at + len(j.prompts)])
                at += len(j.prompts)

    # -- LoRA adapters and sleep mode (engine/residency.py) -------------------------------
    async def load_lora(self, name: str, path: str) -> list[str]:
        """Read the adapter at `path` off the engine thread (LoraError if refused), then make it
        resident between two steps; returns the adapters unloaded for it (LoraSlotsFull when
        every slot's adapter is in use)."""
        core = self.core
        if core.runner.lora is None:
            raise LoraError("LoRA is off on this engine (start it with max_loras > 0)")
        cfg, rank = core.model_config, self.config.max_lora_rank
        adapter = await asyncio.to_thread(read_adapter, name, path, cfg, rank)
        return await self._submit(lambda: self._published(core.load_lora(adapter)))

    async def unload_lora(self, name: str) -> bool:
        return await self._submit(lambda: self._published(self.core.unload_lora(name)))

    def lora_paths(self) -> dict[str, str]:
        """The resident adapters and the directories they were read from (a snapshot: they
        change on the engine thread only)."""
        lora = self.core.runner.lora
        if lora is None:
            return {}
        return {
            a.name: str(a.path) for a in sorted(list(lora.adapters.values()), key=lambda a: a.name)
        }

    async def sleep(self) -> SleepReport:
        return await self._submit(lambda: self._published(self.core.sleep()))

    async def wake_up(self) -> float:
        return await self._submit(lambda: self._published(self.core.wake_up()))

    def _published(self, result: T) -> T:
        """On the engine thread: republish the stats after a change no step reports."""
        self._publish()
        return result

    @property
    def sleeping(self) -> bool:
        return self.core.sleeping

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run an arbitrary read or command against the core on the engine thread."""
        return await self._submit(lambda: fn(self.core))

    def stats(self) -> dict[str, float]:
        """The counters as of the last step or the last request added (a cheap, lock-free
        snapshot)."""
        return self._stats


def _answer(job: _EmbedJob, result: Any) -> None:
    """From the engine thread: a job's rows (as float32 bytes) or its exception, to its loop."""
    job.done(job.tokens)  # before the caller can see it: no longer queued
    if isinstance(result, BaseException):
        job.loop.call_soon_threadsafe(_set_exception, job.fut, result)
    else:
        job.loop.call_soon_threadsafe(_set_result, job.fut, [r.numpy().tobytes() for r in result])


def _noop() -> None:
    pass


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
