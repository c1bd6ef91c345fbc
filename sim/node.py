"""One simulated node: the engine's real Scheduler, KVCacheManager and BlockPool, stepping on
virtual time. Only the forward pass is replaced: a step lasts what the profile's step model
says for that step's (prefill tokens, decode sequences, context, attention).

The step body mirrors EngineCore.step (engine/core.py) minus the model: schedule → the
chunks' tokens become computed → full blocks go to the prefix cache → every sampling chunk
appends one token → finished requests leave through Scheduler.finish (held on a prefill
node). Sampled token ids are a constant: generated text never changes scheduling.

A node that streams (colocated or decode) also pays `token_s` per token the step samples: its
event loop's work for that token (detokenize, SSE frame, write — the profile's measured
`node_token_cpu_s` at the run's contention) shares the process's GIL and core with the engine
thread, so the next step starts that much later. A prefill node answers once per request: 0.
Its pure decode steps (no prompt token) also last `decode_factor` × the model's time: the
profile's measured `decode_step_factor`, what the streaming process adds inside the step.
Nodes that share one machine (`host`, sim/host.py) run their steps' work through it, so a step
that overlaps another node's steps is stretched by the profile's co-run factor.

Invariants: one step at a time per node; `busy_s` is the sum of step times; KV events reach
the coordinator's index when the real node's poller would carry them (sim/event_poll.py: at
the step's end when a poll waited for it, else at the next poll, ≤ 0.1 s later); a node with
nothing schedulable sleeps until `wake()`.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.index import PrefixIndex
from coordinator.subscriber import apply_batch
from engine.block_pool import BlockPool
from engine.kv_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from engine.step_model import shape_of
from node.engines.native import _wire_event
from protocol.kv_events import EventBatch, LoadFrame
from sim.event_poll import EventPoll
from sim.host import SharedHost
from sim.jitter import StepJitter
from sim.profile import StepFeatures, StepModel

#: the token every simulated sample yields (no stop token can match it: EOS is never set)
SIM_TOKEN = 1


@dataclass
class Tracked:
    """What the cluster waits for on a request inside this node."""

    on_token: Callable[[Request, float], None]
    done: asyncio.Future[None]


@dataclass
class NodeStats:
    steps: int = 0
    busy_s: float = 0.0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    #: (time, waiting, running, kv usage) sampled at each load frame
    timeline: list[tuple[float, int, int, float]] = field(default_factory=list)
    step_s: array = field(default_factory=lambda: array("d"))


def features(chunks: list[ScheduledChunk]) -> StepFeatures:
    """The step's shape, as the engine's own online step model reads it (one definition)."""
    s = shape_of(chunks)
    return StepFeatures(
        s.prefill_tokens, s.decode_seqs, s.context_tokens, s.attention, s.cached_attention
    )


class SimNode:
    def __init__(
        self,
        node_id: str,
        role: str,
        step: StepModel,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        on_events: Callable[[str, list], None] | None = None,
        token_s: float = 0.0,
        decode_factor: float = 1.0,
        host: SharedHost | None = None,
        jitter: StepJitter | None = None,
    ) -> None:
        self.node_id = node_id
        self.role = role
        self.step_model = step
        self.token_s = token_s
        self.decode_factor = decode_factor
        self.host = host
        self.jitter = jitter
        self.pool = BlockPool(num_blocks, block_size, record_events=on_events is not None)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens, max_num_seqs, True), self.kv
        )
        self.on_events = on_events
        self.on_reserved: Callable[[SimNode, Request], None] = lambda node, req: None
        self.tracked: dict[str, Tracked] = {}
        self.stats = NodeStats()
        self.load_seq = 0
        self._wake = asyncio.Event()
        self._poll = EventPoll(self._flush_events, lambda: bool(self.pool.events))

    # -- requests ------------------------------------------------------------------------------
    def add(self, req: Request, on_token: Callable[[Request, float], None]) -> asyncio.Future[None]:
        """Queue `req`; the future resolves when it finishes (held, on a prefill node)."""
        done = asyncio.get_running_loop().create_future()
        self.tracked[req.request_id] = Tracked(on_token, done)
        self.scheduler.add(req)
        self.wake()
        return done

    def wake(self) -> None:
        self._wake.set()

    def kv_ready(self, request_id: str) -> None:
        self.scheduler.kv_ready(request_id, True)
        self.wake()

    def release(self, request_id: str) -> None:
        self.scheduler.release(request_id)
        self.wake()

    # -- load, as the node reports it (node/kv_events.py + node/engines/native.py::_drain) -----
    def load_frame(self, now: float) -> LoadFrame:
        s = self.scheduler
        queued = s.queued_prefill_tokens()
        self.load_seq += 1
        self.stats.timeline.append((now, s.num_waiting, s.num_running, self.pool.usage))
        return LoadFrame(
            seq=self.load_seq,
            ts=now,
            num_requests_waiting=s.num_waiting,
            num_requests_running=s.num_running,
            kv_cache_usage_perc=self.pool.usage,
            queued_prefill_tokens=queued,
            kv_blocks_free=self.pool.num_free,
            kv_blocks_total=self.pool.num_blocks,
        )

    # -- the step loop -------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            out = self.scheduler.schedule()
            for req in out.reserved:
                self.on_reserved(self, req)
            if not out.chunks:
                self._poll.events_made(loop.time())  # a finish or release between steps
                self._wake.clear()
                await self._wake.wait()
                continue
            f = features(out.chunks)
            work = self.step_model.seconds(f)
            if f.prefill_tokens == 0:
                work *= self.decode_factor
            if self.jitter is not None:  # sensitivity runs (sim/jitter.py)
                work *= self.jitter.factor()
            # the event loop's per-token work: the node's own GIL and core, not the machine's
            extra = self.token_s * sum(1 for c in out.chunks if c.samples) if self.token_s else 0.0
            t0 = loop.time()
            self._poll.step_started(t0)
            for c in out.chunks:
                if c.req.first_scheduled_time is None:
                    c.req.first_scheduled_time = t0
            if self.host is None:
                dt = work + extra
                await asyncio.sleep(dt)
            else:
                await self.host.step(work, prefill=f.prefill_tokens > 0)
                if extra:
                    await asyncio.sleep(extra)
                dt = loop.time() - t0
            st = self.stats
            st.steps += 1
            st.busy_s += dt
            st.step_s.append(dt)
            st.prompt_tokens_computed += f.prefill_tokens
            self._apply(out.chunks, loop.time())
            self._poll.step_ended(loop.time())

    def _apply(self, chunks: list[ScheduledChunk], now: float) -> None:
        for c in chunks:
            c.req.num_computed_tokens = c.start + c.num_tokens
            self.kv.cache_computed_blocks(c.req)
        for c in chunks:
            if not c.samples or c.req.finish_reason is not None:
                continue
            req = c.req
            if req.first_token_time is None:
                req.first_token_time = now
            req.output_token_ids.append(SIM_TOKEN)
            self.stats.generation_tokens += 1
            t = self.tracked[req.request_id]
            t.on_token(req, now)
            if len(req.output_token_ids) >= req.params.max_tokens:
                self.scheduler.finish(req, "length")
                del self.tracked[req.request_id]
                if not t.done.done():  # cancelled: a run stopped early (sim/early.py)
                    t.done.set_result(None)

    def _flush_events(self) -> None:
        if self.on_events is not None and self.pool.events:
            self.on_events(self.node_id, self.pool.drain_events())


def apply_events(index: PrefixIndex, node_id: str, seq: int, now: float, events: list) -> None:
    """Engine events → the wire structs (the native adapter's own conversion) → the
    coordinator subscriber's `apply_batch`: the index sees exactly what a real stream brings."""
    apply_batch(
        index, node_id, EventBatch(seq=seq, ts=now, events=[_wire_event(e) for e in events])
    )
