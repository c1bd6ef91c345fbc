"""Continuous-batching scheduler: which requests compute how many tokens in the next step.

Each step has a token budget. Running requests go first (decodes need one token each, a
partly prefilled prompt continues its chunk), then waiting requests are admitted in priority
order (interactive before batch, then arrival), their prompt split into chunks that fit what
is left of the budget (chunked prefill). When blocks run out a running request is preempted
by recompute: its blocks go back to the pool (they stay in the prefix cache until reused, so
the recompute is often cheap) and it waits again at the front of its class. An interactive
request that cannot be admitted preempts running batch requests.

Remote KV (decode node): a request whose prompt KV comes from a prefill node is first
*reserved* (blocks allocated, status WAITING_FOR_REMOTE_KV, reported in `reserved`), then
joins the running set when the node calls `kv_ready` (after the transfer or its failure).

Speculative decoding: with a `drafter` set, a decoding request (prompt done, one token to
compute) may carry draft tokens in its chunk (`ScheduledChunk.draft`), within the step's budget
and with slots allocated for them; the engine verifies them after the forward pass and gives the
slots of rejected tokens back (`KVCacheManager.trim`). No drafts while more than
`spec_max_batch` requests run or wait: at larger batches the step is compute-bound and verifying
drafts costs more than the accepted tokens give back.

ITL target (`itl_target_s`, colocated nodes): decodes are scheduled as always, and the prompt
tokens of the step are capped at the most that keep the step's predicted time within the target
(engine/step_model.py, an online fit of measured step times against the step's shape), but never
below `min_prefill_chunk`, so a long prompt always progresses. The engine reports each step's
wall time through `observe_step`. Without a target the budget is the fixed token budget alone.

Shares (any node, engine/shares.py): blocks referenced for a peer that pulls them, under the
same hold ledger and expiry as held prefills.

Invariants: a request is in exactly one of waiting / running / remote / held; the scheduler
never changes a block while a transfer may be writing it (requests in WAITING_FOR_REMOTE_KV
are never preempted and are freed only after `kv_ready`); a held request carries its own
expiry (`hold_expiry`), so holding is atomic with its lease: the engine thread frees expired
holds itself (`expire_holds`), and an abort frees a held request's blocks.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from engine import kv_moves
from engine.holds import HoldLedger
from engine.kv_manager import KVCacheManager
from engine.request import Request, Status
from engine.shares import Shares
from engine.step_model import OnlineStepModel, StepShape, shape_of
from protocol.kv_digest import BytesHash, KVCheck


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    #: ITL target (seconds): prompt tokens per step sized by the step-time model; None: fixed budget
    itl_target_s: float | None = None
    #: with a target, the fewest prompt tokens a step may carry (prefill is never starved)
    min_prefill_chunk: int = 32

    def __post_init__(self) -> None:
        if self.itl_target_s is not None:
            if not self.itl_target_s > 0:
                raise ValueError(f"the ITL target must be positive (got {self.itl_target_s} s)")
            if not self.enable_chunked_prefill:
                raise ValueError(
                    "an ITL target needs chunked prefill (it sizes the prefill chunks)"
                )
            if self.min_prefill_chunk < 1:
                raise ValueError("min_prefill_chunk must be at least 1")


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # first position computed this step
    num_tokens: int  # including the draft
    #: speculative tokens after the request's last known token (their positions are computed too)
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last known token (so it yields logits)."""
        return self.start + self.num_tokens - len(self.draft) == self.req.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    reserved: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.held: dict[str, Request] = {}  # finished, blocks kept for a transfer

        #: the holds as the event loop may claim them (engine/holds.py)
        self.ledger = HoldLedger()
        #: blocks referenced for peers' pulls (engine/shares.py), under the same ledger
        self.shares = Shares(kv, self.ledger)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        #: speculative decoding: draft tokens for a decoding request ([] for none)
        self.drafter: Callable[[Request, int], list[int]] | None = None
        #: called once before a drafting step with its decoding requests (a draft model
        #: batches them)
        self.prepare_drafts: Callable[[list[Request]], None] | None = None
        self.spec_max_batch = 0
        #: with an ITL target: the step-time model, and the shape of the step scheduled last
        self.step_model = OnlineStepModel() if config.itl_target_s is not None else None
        self._last_shape: StepShape | None = None
        #: the prompt-token cap of the last step (the full budget without a target)
        self.last_prefill_budget = config.max_num_batched_tokens

    # -- queue management ------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests or req.request_id in self.held:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        req.status = Status.WAITING if req.num_preemptions == 0 else Status.PREEMPTED
        keys = [r.sort_key for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, req.sort_key), req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.remote)

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens of the requests not yet admitted (the queue's size in work)."""
        return sum(r.num_tokens for r in self.waiting) + sum(
            r.num_prompt_tokens for r in self.remote.values()
        )

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to prefill: the waiting requests' and the running ones'
        remainders (what the coordinator's routing counts as a node's queued prefill work)."""
        return sum(
            max(0, r.num_prompt_tokens - r.num_computed_tokens)
            for r in (*self.waiting, *self.running)
        )

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- preemption ------------------------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.reset_for_recompute(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        self._enqueue(victim)

    def _admission_blocked(self, req: Request) -> bool:
        need = self.kv.find_cached_prefix(req)
        return len(self.running) >= self.config.max_num_seqs or not self.kv.can_allocate(
            req, 1, need
        )

    def _priority_preempt(self, out: SchedulerOutput) -> None:
        """Make room for the best waiting request when it outranks running ones."""
        if not self.waiting:
            return
        head = self.waiting[0]
        while self.running and self._admission_blocked(head):
            victim = max(self.running, key=lambda r: r.sort_key)
            if victim.priority <= head.priority:
                return
            self._preempt(victim, out)

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._priority_preempt(out)
        num_priority_preempted = len(out.preempted)
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda r: r.sort_key)
        # prompt tokens this step may still take; never below `budget` without a target
        prefill_left = self.last_prefill_budget = self._prefill_budget(budget)
        # the batch counts the requests queued behind the decoding ones: at the start of a big
        # batch only a few decode while the rest prefill, and drafting then would only cost
        drafting = (
            self.drafter is not None
            and self._num_decoding() > 0
            and len(self.running) + len(self.waiting) <= self.spec_max_batch
        )
        if drafting and self.prepare_drafts is not None:
            self.prepare_drafts(
                [
                    r
                    for r in self.running
                    if r.output_token_ids and r.num_tokens - r.num_computed_tokens == 1
                ]
            )
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            prompt_work = _prompt_work(req)
            if prompt_work:
                n = min(n, prefill_left)
            if n <= 0:
                i += 1
                continue
            if drafting and n == 1 and req.output_token_ids and budget > 1:
                assert self.drafter is not None  # drafting: a drafter is set
                draft = self.drafter(req, budget - 1)
                if draft and self.kv.allocate_slots(req, 1 + len(draft)):
                    out.chunks.append(
                        ScheduledChunk(req, req.num_computed_tokens, 1 + len(draft), draft)
                    )
                    budget -= 1 + len(draft)
                    i += 1
                    continue
            if (
                not self.config.enable_chunked_prefill
                and n < req.num_tokens - req.num_computed_tokens
            ):
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                budget -= n
                prefill_left -= n if prompt_work else 0
                i += 1
                continue
            # `req` itself was preempted; the list shifted, so `i` already names the next one.
        # Blocks ran out for running requests: admitting new ones now would only thrash.
        if len(out.preempted) == num_priority_preempted:
            budget = self._admit_waiting(out, budget, prefill_left)
        if self.step_model is not None:
            self._last_shape = shape_of(out.chunks)
        return out

    def _prefill_budget(self, budget: int) -> int:
        """The step's cap on prompt tokens: with an ITL target, the most the step-time model lets
        ride along this step's decodes (at least `min_prefill_chunk`); else the whole budget.
        The chunk is placed at the first prompt in line (the running ones first, as scheduled)."""
        if self.step_model is None or self.config.itl_target_s is None:
            return budget
        decoding = [r for r in self.running if not _prompt_work(r)]
        context = sum(r.num_computed_tokens + 1 for r in decoding)
        first = next(
            (r for r in self.running if _prompt_work(r)), self.waiting[0] if self.waiting else None
        )
        start = first.num_computed_tokens if first is not None else 0
        fit = self.step_model.max_prefill(
            len(decoding), context, start, self.config.itl_target_s, budget
        )
        return max(fit, min(self.config.min_prefill_chunk, budget))

    def observe_step(self, seconds: float) -> None:
        """The engine's measured wall time of the step scheduled last (fits the step model)."""
        shape, self._last_shape = self._last_shape, None
        if (
            self.step_model is not None
            and shape is not None
            and (shape.prefill_tokens or shape.decode_seqs)
        ):
            self.step_model.observe(shape, seconds)

    def _num_decoding(self) -> int:
        return sum(
            1
            for r in self.running
            if r.output_token_ids and r.num_tokens - r.num_computed_tokens == 1
        )

    def _admit_waiting(self, out: SchedulerOutput, budget: int, prefill_left: int) -> int:
        full_budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.remote_num_tokens > 0 and req.num_preemptions == 0:
                if not self._reserve(req):
                    break
                out.reserved.append(req)
                continue
            if budget <= 0 or prefill_left <= 0:
                break
            cached = self.kv.find_cached_prefix(req)
            tiered = self.kv.find_tiered(req, len(cached))
            remaining = req.num_tokens - (len(cached) + len(tiered)) * self.kv.block_size
            n = min(remaining, budget, prefill_left)
            if not self.config.enable_chunked_prefill and n < remaining and budget < full_budget:
                break
            if self.config.enable_chunked_prefill is False:
                n = remaining
            if not self.kv.can_allocate(req, n, cached, len(tiered)):
                break
            self.waiting.pop(0)
            # spilled blocks come back (checked) before the request computes; a block that
            # fails leaves fewer tokens computed, and this chunk starts there
            self.kv.admit(req, cached, req.num_preemptions == 0, tiered)
            ok = self.kv.allocate_slots(req, n)
            assert ok, "can_allocate promised room"
            req.status = Status.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
            prefill_left -= n
        return budget

    # -- remote KV (decode node) -----------------------------------------------------------
    def _reserve(self, req: Request) -> bool:
        """Blocks for a request's remote KV, after its local prefix (pool, then spill tiers)."""
        upto = req.remote_num_tokens - 1
        cached = self.kv.find_cached_prefix(req, max_tokens=upto)
        tiered = self.kv.find_tiered(req, len(cached), max_tokens=upto)
        total = req.remote_num_tokens - (len(cached) + len(tiered)) * self.kv.block_size
        if not self.kv.can_allocate(req, total, cached, len(tiered)):
            return False
        self.waiting.pop(0)
        # may keep fewer (a block that failed its digest): the transfer fills the rest
        self.kv.admit(req, cached, tiered=tiered)
        ok = self.kv.allocate_slots(req, req.remote_num_tokens - req.num_computed_tokens)
        assert ok, "can_allocate promised room"
        req.status = Status.WAITING_FOR_REMOTE_KV
        self.remote[req.request_id] = req
        return True

    def kv_ready(
        self,
        request_id: str,
        ok: bool,
        quarantine: bool = False,
        digests: Sequence[int | None] | None = None,
        where: str = "transfer",
        hashed: Mapping[int, BytesHash] | None = None,
    ) -> tuple[Request | None, KVCheck]:
        """The transfer for a reserved (or still queued) request ended. ok: the remote tokens
        count, as far as they match `digests` (engine/kv_moves.py `arrived`); not ok: compute
        everything past the local prefix hit. quarantine (with not ok): the transfer may still
        write into the blocks it targeted, so they are set aside until `release_quarantine` and
        the request recomputes into fresh blocks. Returns the request (None if unknown) and how
        the KV checked out."""
        req = self.remote.pop(request_id, None)
        if req is None:
            queued = self.requests.get(request_id)
            if (
                queued is not None
                and queued in self.waiting
                and queued.remote_num_tokens
                and not ok
            ):
                queued.remote_num_tokens = 0  # the KV will not come: admit it to compute it all
                return queued, KVCheck.FAILED
            return None, KVCheck.UNKNOWN
        if quarantine and not ok:
            self.kv.quarantine(req, req.num_cached_tokens // self.kv.block_size)
        if req.finish_reason is not None:  # aborted while its transfer ran: free it now
            req.status = Status.FINISHED
            self.requests.pop(req.request_id, None)
            self.kv.free(req)
            self.kv.forget(req)
            return req, KVCheck.FAILED if not ok else KVCheck.READY
        check = kv_moves.arrived(self.kv, req, digests, where, hashed) if ok else KVCheck.FAILED
        if where == "peer":  # a pulled prefix: this node computes the rest of the prompt
            self.kv.count_pulled(req, req.num_computed_tokens - req.num_cached_tokens)
        req.status = Status.RUNNING
        self.running.append(req)
        return req, check

    # -- completion ------------------------------------------------------------------------
    def finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """Finish `req` (stop/length/abort). Its blocks are freed unless it holds them for a
        transfer; a request still waiting for remote KV only gets flagged (freed at kv_ready)."""
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if req.status is Status.WAITING_FOR_REMOTE_KV:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        self.requests.pop(req.request_id, None)
        if req.hold_blocks and reason not in ("abort", "error"):
            req.held_digests = self.kv.transfer_digests(req)
            if req.hold_seconds is not None:
                req.hold_expiry = time.monotonic() + req.hold_seconds
            self.held[req.request_id] = req
            self.ledger.add(req.request_id, req.block_ids, req.hold_expiry)
        else:
            self.kv.free(req)
        self.kv.forget(req)

    def release(self, request_id: str) -> bool:
        """Free the blocks of a held request (transfer done, lease expired, or aborted)."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.ledger.drop(request_id)
        self.kv.free(req)
        return True

    def expire_holds(self, now: float) -> list[str]:
        """Free every hold and share whose lease ran out; returns their ids. One the event loop
        claimed just before its deadline is left to the release command already on its way."""
        due = [
            rid
            for rid, r in self.held.items()
            if r.hold_expiry is not None and r.hold_expiry <= now
        ]
        gone = []
        for rid in due:
            if self.ledger.expire(rid):
                self.release(rid)
                gone.append(rid)
            else:
                self.held[rid].hold_expiry = None  # claimed: no deadline to wake up for
        return gone + self.shares.expire(now)

    def next_hold_expiry(self) -> float | None:
        times = [r.hold_expiry for r in self.held.values() if r.hold_expiry is not None]
        share = self.shares.next_expiry()
        return min([*times, share] if share is not None else times, default=None)


def _prompt_work(req: Request) -> bool:
    """True unless `req` is decoding (a sampled token and exactly that one token to compute):
    a prompt chunk, a prompt's last token, or a preempted request's recompute."""
    return not req.output_token_ids or req.num_tokens - req.num_computed_tokens != 1
