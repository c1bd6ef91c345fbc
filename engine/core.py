"""EngineCore: one engine instance — validation, the step loop body, P/D hooks, counters.

Single-threaded by contract: every method is called from one thread (the AsyncEngine's engine
thread, or the caller of the offline LLM). A step = expire holds → schedule → one forward pass
→ sample → apply stop conditions → deltas. Logprobs (sampled tokens and prompt tokens) are
computed only for the requests that ask, from the raw logits (engine/sampler.py).

P/D: a guided decode leg's first output token is the one the prefill node sampled under the
guide (`params.first_token`, checked against the grammar when the request is added). Its first
sampling row is computed and drawn as any other (a seeded generator advances as on P), and P's
token replaces the draw; logprobs score P's token under this node's raw logits.

Faults are isolated per request: a forward pass that raises fails that step's requests (their
blocks are freed, finish_reason "error") and a row that cannot be sampled fails its request
alone; the engine keeps stepping. Only an error outside a request's work (the scheduler's own
state) escapes `step` and kills the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig, parse_size
from engine.convert import ensure_converted
from engine.dtype_choice import choose_dtype
from engine.embed import EmbedCapacityError, Embedder, Pooling, finish
from engine.guided import GuidedDecoding, GuideError
from engine.kv_digest import PoolBytes
from engine.kv_manager import KVCacheManager
from engine.kv_quant import kv_layout_dtype
from engine.kv_tiers import build_tiers
from engine.logits_process import penalize
from engine.model_config import ModelConfig
from engine.outputs import Fault, RequestOutput, TextState
from engine.request import Priority, Request
from engine.residency import Residency
from engine.retention import Retention
from engine.runner import DTYPE_NAMES, ModelRunner, PoolFactory, zeroed_pool
from engine.sampler import Sampler, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from engine.spec_decode import Speculator, build_speculator, spec_max_batch
from protocol.block_hash import domain_root
from protocol.kv_digest import BytesHash, KVCheck
from protocol.kv_layout import KVLayout
from protocol.logprobs import TokenLogprob
from runtime.models import resolve_model
from text.tokenizer import Tokenizer

log = logging.getLogger("duet.engine")


class RequestError(ValueError):
    """A request the engine refuses (the node answers 400)."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (by requests or tokens): retry later or elsewhere (503)."""


@dataclass
class EngineCounters:
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    steps: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_rejected_queue_full: int = 0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class EngineCore(Residency):
    def __init__(self, config: EngineConfig, pool_factory: PoolFactory = zeroed_pool) -> None:
        self.config = config
        ref = resolve_model(config.model)
        self.model_name = ref.name
        self.model_dir = ensure_converted(ref, progress=log.info)
        self.model_config = mc = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.device = resolve_device(config.device)
        choice = choose_dtype(config.dtype, self.device, mc.torch_dtype)
        self.dtype = choice.dtype
        log.info("dtype %s (%s)", str(self.dtype).removeprefix("torch."), choice.reason)
        if config.threads and self.device.type == "cpu":
            torch.set_num_threads(config.threads)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context "
                f"({mc.max_position_embeddings} positions)"
            )
        if config.max_waiting_requests < 1 or config.max_waiting_tokens < 1:
            raise ValueError("max_waiting_requests and max_waiting_tokens must be at least 1")
        bs = config.block_size
        kv_dtype = kv_layout_dtype(config.kv_cache_dtype, DTYPE_NAMES[self.dtype])
        # the pool's bytes per block, scales included (an int8 pool's rows end with theirs)
        block_bytes = KVLayout(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=bs,
            dtype=kv_dtype,
            num_blocks=1,
        ).block_bytes
        num_blocks = config.num_kv_blocks or parse_size(config.kv_memory) // block_bytes
        if num_blocks * bs < self.max_model_len:
            raise ValueError(
                f"KV pool of {num_blocks} blocks ({num_blocks * bs} tokens) cannot hold one "
                f"sequence of max_model_len={self.max_model_len} tokens: give it more KV memory "
                f"or blocks, or lower max_model_len"
            )
        self.runner = ModelRunner(
            self.model_dir,
            mc,
            self.dtype,
            self.device,
            num_blocks,
            bs,
            self.max_model_len,
            pool_factory,
            config.quantization,
            config.max_loras,
            config.max_lora_rank,
            kv_dtype,
        )
        self.pool = BlockPool(num_blocks, bs, record_events=config.record_kv_events)
        self.pool_bytes = PoolBytes(self.runner.kv_cache)
        self.tiers = build_tiers(config, self.pool_bytes, self.pool)
        # prefixes clients asked to keep (`cache_control`): evicted last, spilled, not dropped
        self.retention = Retention(bs, config.hash_seed)
        self.pool.retained = self.retention
        if self.tiers is not None:
            self.tiers.retained = self.retention
        self.kv = KVCacheManager(
            self.pool,
            config.enable_prefix_caching,
            config.hash_seed,
            digester=self.pool_bytes,
            tiers=self.tiers,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_batched_tokens,
                config.max_num_seqs,
                config.enable_chunked_prefill,
                None if config.itl_target_ms is None else config.itl_target_ms / 1e3,
            ),
            self.kv,
        )
        self.sampler = Sampler(config.seed)
        self.guides = GuidedDecoding(
            self.model_dir / "tokenizer.json", mc.vocab_size, self.tokenizer.eos_token_ids
        )
        self.speculator: Speculator | None = None
        if config.speculative:
            self.speculator = build_speculator(
                config,
                self.model_dir,
                mc,
                self.dtype,
                self.device,
                num_blocks,
                self.max_model_len,
                self.sampler,
            )
            self.scheduler.drafter = self.speculator.draft
            self.scheduler.prepare_drafts = self.speculator.prepare
            self.scheduler.spec_max_batch = spec_max_batch(config)
        self.embedder = Embedder(self.runner, self.pool, config.max_num_batched_tokens)
        self.counters = EngineCounters()
        self.progressed = False  # whether the last step changed anything
        #: sleep mode (engine/sleep.py): the weights are dropped and the pool released
        self.sleeping = False
        self.last_wake_s: float | None = None
        self.wakes = 0
        self._text: dict[str, TextState] = {}
        log.info(
            "engine ready: model=%s dtype=%s kv_dtype=%s device=%s kv_blocks=%d (%.0f MiB, "
            "%d tokens)",
            self.model_name,
            DTYPE_NAMES[self.dtype],
            self.runner.kv_layout.dtype,
            self.device,
            num_blocks,
            num_blocks * block_bytes / 2**20,
            num_blocks * bs,
        )

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        hold_blocks: bool = False,
        remote_num_tokens: int = 0,
        hold_seconds: float | None = None,
    ) -> Request:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(ids)
        if self.sleeping:  # a request wakes a sleeping engine
            self.wake_up()
        if remote_num_tokens and params.prompt_logprobs is not None:
            raise RequestError(
                "prompt_logprobs cannot be computed for a prompt whose KV comes from a prefill node"
            )
        if remote_num_tokens and not 0 < remote_num_tokens <= len(ids):
            raise RequestError(
                f"remote KV covers {remote_num_tokens} tokens of a {len(ids)}-token prompt"
            )
        bad = next(
            (t for t in params.logit_bias if not 0 <= t < self.model_config.vocab_size), None
        )
        if bad is not None:
            raise RequestError(
                f"logit_bias names token id {bad}, outside the vocabulary "
                f"[0, {self.model_config.vocab_size})"
            )
        if params.lora_name is not None and (why := self.lora_refusal(params.lora_name)):
            raise RequestError(why)
        self._check_queue(len(ids))
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            priority=priority,
            eos_token_ids=frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids,
            hold_blocks=hold_blocks,
            hold_seconds=hold_seconds,
            remote_num_tokens=remote_num_tokens,
        )
        if (
            params.first_token is not None
            and not 0 <= params.first_token < self.model_config.vocab_size
        ):
            raise RequestError(
                f"the prefill node's first token {params.first_token} is outside the vocabulary "
                f"[0, {self.model_config.vocab_size})"
            )
        if (
            params.guide is not None
        ):  # compiled already when it came through AsyncEngine (off this thread)
            done = params.resume.output_tokens if params.resume is not None else 0
            try:
                self.guides.attach(
                    request_id,
                    params.guide,
                    ids[len(ids) - done :] if done else [],
                    params.first_token,
                    params.cache_salt,
                )
            except GuideError as e:
                raise RequestError(str(e)) from None
        try:
            self.scheduler.add(req)
        except ValueError as e:
            self.guides.forget(request_id)
            raise RequestError(str(e)) from None
        self.retention.retain_prompt(ids, params)
        if params.lora_name is not None:  # queued or running: its adapter stays resident
            assert self.runner.lora is not None  # lora_refusal passed: the engine serves LoRA
            self.runner.lora.acquire(params.lora_name)
        text = (self.tokenizer, ids, params.stop, params.skip_special_tokens)
        # a migrated request continues the text the client already has (protocol/resume.py)
        self._text[request_id] = (
            TextState(*text) if params.resume is None else TextState.resumed(*text, params.resume)
        )
        return req

    def queue_full(self, extra_tokens: int = 1) -> bool:
        """True when one more request of `extra_tokens` would overflow the waiting queue (an
        empty queue always takes a request, however long: otherwise it could never run)."""
        s, c = self.scheduler, self.config
        if not s.num_waiting:
            return False
        return (
            s.num_waiting >= c.max_waiting_requests
            or s.num_waiting_tokens + extra_tokens > c.max_waiting_tokens
        )

    def _check_queue(self, num_tokens: int) -> None:
        if self.queue_full(num_tokens):
            self.counters.requests_rejected_queue_full += 1
            s = self.scheduler
            raise EngineOverloaded(
                f"the engine queue is full ({s.num_waiting} requests, {s.num_waiting_tokens} "
                f"prompt tokens waiting; limits {self.config.max_waiting_requests} requests, "
                f"{self.config.max_waiting_tokens} tokens)"
            )

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt is {len(ids)} tokens, but this model's context is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token)"
            )
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")

    def embed(
        self, prompts: list[list[int]], pooling: Pooling, dimensions: int | None = None
    ) -> torch.Tensor:
        """[B, d] fp32 L2-normalized embeddings of token-id prompts (engine/embed.py); d is
        `dimensions` or the hidden size. RequestError for a prompt the model cannot take, or for
        a `dimensions` outside 1..hidden size; EngineOverloaded when generation holds the pool."""
        size = self.model_config.hidden_size
        if dimensions is not None and not 1 <= dimensions <= size:
            raise RequestError(
                f"dimensions must be between 1 and {size} (this model's embedding size), "
                f"got {dimensions}"
            )
        vocab = self.model_config.vocab_size
        for i, ids in enumerate(prompts):
            if not ids:
                raise RequestError(f"input {i} is empty")
            if len(ids) > self.max_model_len:
                raise RequestError(
                    f"input {i} is {len(ids)} tokens, but this model's context is "
                    f"{self.max_model_len} tokens"
                )
            if min(ids) < 0 or max(ids) >= vocab:
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise RequestError(
                    f"input {i}: token id {bad} is outside the vocabulary [0, {vocab})"
                )
        if self.sleeping:
            self.wake_up()
        try:
            pooled = self.embedder.embed(prompts, pooling)
        except EmbedCapacityError as e:
            raise EngineOverloaded(str(e)) from None
        self.counters.prompt_tokens_computed += sum(map(len, prompts))
        return finish(pooled, dimensions)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """Monotonic time of the next event the engine must wake for on its own (a hold's
        expiry), or None."""
        return self.scheduler.next_hold_expiry()

    def step(self) -> tuple[list[RequestOutput], list[Request]]:
        """One scheduling step. Returns the deltas and the requests newly reserved for remote
        KV (decode node: their transfers may start). `progressed` tells whether anything
        changed (False: only a command or a deadline can unblock the queue)."""
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:  # the step's wall time, for the step-time model of an ITL target
            self.scheduler.observe_step(time.perf_counter() - t0)

    def _step(self) -> tuple[list[RequestOutput], list[Request]]:
        expired = self.scheduler.expire_holds(time.monotonic())
        self.retention.tick()
        if expired:
            log.info("lease expired: freed the held blocks of %s", ", ".join(expired))
        sched = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        self.progressed = bool(expired or sched.chunks or sched.reserved or sched.preempted)
        if not sched.chunks:
            return outputs, sched.reserved
        now = time.monotonic()
        for c in sched.chunks:
            if c.req.first_scheduled_time is None:
                c.req.first_scheduled_time = now
        try:
            samplers, logits, prompt_rows = self.runner.execute(sched.chunks)
        except Exception as e:  # this step's requests fail; everyone else goes on
            log.exception(
                "forward pass failed: failing the %d request(s) of this step", len(sched.chunks)
            )
            for c in sched.chunks:
                outputs.append(
                    self.fail(c.req, f"the forward pass failed: {type(e).__name__}: {e}")
                )
            return outputs, sched.reserved
        self.counters.steps += 1
        for c in sched.chunks:
            req = c.req
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.counters.prompt_tokens_computed += min(
                    c.num_tokens, req.num_prompt_tokens - c.start
                )
            req.num_computed_tokens = (
                c.start + c.num_tokens - len(c.draft)
            )  # drafts count once accepted
            self.kv.cache_computed_blocks(req)
        if any(c.draft for c in samplers):
            return self._spec_outputs(samplers, logits, prompt_rows, outputs), sched.reserved
        outputs.extend(self._sample_and_append(samplers, logits, prompt_rows))
        return outputs, sched.reserved

    def _sample_and_append(
        self, samplers: list[ScheduledChunk], logits: torch.Tensor, prompt_rows: list
    ) -> list[RequestOutput]:
        """One token per chunk from its row of `logits` (prompt logprobs first), appended."""
        outputs: list[RequestOutput] = []
        rows = [
            (c.req.request_id, c.req.params, len(c.req.output_token_ids) >= c.req.params.min_tokens)
            for c in samplers
        ]
        for pr in prompt_rows:  # before sampling: the first token's delta carries them
            targets = pr.req.prompt_token_ids[pr.first + 1 : pr.first + 1 + len(pr.logits)]
            n = pr.req.params.prompt_logprobs or 0
            pr.req.prompt_logprobs.extend(token_logprobs(pr.logits, targets, [n] * len(targets)))
        if not samplers:
            return outputs
        # penalties, then the guides' masks, on a copy: logprobs below score the raw logits
        adjusted = penalize(logits, [c.req for c in samplers])
        guided = [
            (i, c.req.request_id)
            for i, c in enumerate(samplers)
            if self.guides.guided(c.req.request_id)
        ]
        adjusted, dead = self.guides.mask(adjusted, guided, copy=adjusted is logits)
        tokens, errors = self.sampler.sample_rows(
            adjusted, rows, [c.req.eos_token_ids for c in samplers]
        )
        errors.update(dead)
        for i, c in enumerate(samplers):  # P/D: a guided leg's first token is the one P sampled
            first = c.req.params.first_token
            if first is not None and not c.req.output_token_ids and i not in errors:
                tokens[i] = first  # checked against the guide when added; this row's draw was made
        lps = self._logprobs(samplers, logits, tokens, errors)
        now = time.monotonic()
        for i, (c, tok) in enumerate(zip(samplers, tokens, strict=True)):
            if i in errors:
                log.warning("request %s failed: %s", c.req.request_id, errors[i])
                outputs.append(self.fail(c.req, errors[i], Fault.REQUEST))
            else:
                outputs.append(self._append_token(c.req, tok, now, lps.get(i)))
        return outputs

    def _spec_outputs(
        self,
        samplers: list[ScheduledChunk],
        logits: torch.Tensor,
        prompt_rows: list,
        outputs: list[RequestOutput],
    ) -> list[RequestOutput]:
        """A step with speculative chunks: plain chunks sample their one row as usual; each
        speculative chunk verifies its draft, emits the accepted tokens and one more in one
        delta, and gives back the KV slots of the rejected ones."""
        starts, at = [], 0
        for c in samplers:
            starts.append(at)
            at += 1 + len(c.draft)
        plain = [i for i, c in enumerate(samplers) if not c.draft]
        if plain:
            sub = logits[[starts[i] for i in plain]]
            outs = self._sample_and_append([samplers[i] for i in plain], sub, prompt_rows)
        else:
            outs = self._sample_and_append([], logits[:0], prompt_rows)
        by_chunk = dict(zip(plain, outs, strict=True))
        now = time.monotonic()
        for i, c in enumerate(samplers):
            if i in by_chunk:
                outputs.append(by_chunk[i])
                continue
            req = c.req
            rows = logits[starts[i] : starts[i] + 1 + len(c.draft)]
            try:
                assert self.speculator is not None  # a chunk carries a draft only then
                emitted = self.speculator.verify(c, rows)
                n_top = req.params.logprobs
                # from the raw rows, as one-token steps score them (the same rows, bit for bit)
                lps = (
                    token_logprobs(rows[: len(emitted)], emitted, [n_top] * len(emitted))
                    if n_top is not None
                    else None
                )
            except Exception as e:  # this request fails alone
                outputs.append(
                    self.fail(req, f"speculative verification failed: {type(e).__name__}: {e}")
                )
                continue
            out: RequestOutput | None = None
            for j, tok in enumerate(emitted):
                o = self._append_token(req, tok, now, lps[j] if lps is not None else None)
                if out is not None:  # one delta for the step's tokens
                    o.new_token_ids = out.new_token_ids + o.new_token_ids
                    o.new_text = out.new_text + o.new_text
                    if out.logprobs is not None:
                        o.logprobs = out.logprobs + (o.logprobs or [])
                out = o
                if o.finished:
                    break
            assert out is not None
            outputs.append(out)
            if not out.finished:  # KV of the accepted drafts stands; the rejected slots go back
                req.num_computed_tokens = c.start + len(emitted)
                self.kv.cache_computed_blocks(req)
                self.kv.trim(req, req.num_tokens)
        return outputs

    def _logprobs(
        self,
        samplers: list[ScheduledChunk],
        logits: torch.Tensor,
        tokens: list[int],
        errors: dict[int, str],
    ) -> dict[int, TokenLogprob]:
        """{row: the sampled token's logprob record} for the rows whose request asked."""
        want = [
            i
            for i, c in enumerate(samplers)
            if c.req.params.logprobs is not None and i not in errors
        ]
        if not want:  # the common case: no extra work on the step's path
            return {}
        nums = [samplers[i].req.params.logprobs or 0 for i in want]
        return dict(
            zip(want, token_logprobs(logits[want], [tokens[i] for i in want], nums), strict=True)
        )

    def fail(self, req: Request, message: str, fault: Fault = Fault.ENGINE) -> RequestOutput:
        """Finish `req` with finish_reason "error" (its blocks are freed, never held)."""
        text = self._text.get(req.request_id)
        finished = text.finish() if text else ""
        out = RequestOutput(req.request_id, [], finished, error=message, fault=fault)
        self.counters.requests_failed += 1
        self._finish(req, "error", None, out)
        return out

    def _append_token(
        self, req: Request, tok: int, now: float, lp: TokenLogprob | None = None
    ) -> RequestOutput:
        if req.first_token_time is None:
            req.first_token_time = now
        req.output_token_ids.append(tok)
        self.counters.generation_tokens += 1
        try:  # a guided request: its matcher takes the token; a complete grammar ends the request
            complete = self.guides.advance(req.request_id, tok)
        except GuideError as e:
            return self.fail(req, str(e), Fault.REQUEST)
        p = req.params
        reason: str | None = None
        stop_reason: str | int | None = None
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens and (
            tok in req.eos_token_ids or tok in p.stop_token_ids or complete
        ):
            reason, stop_reason = "stop", (tok if tok in p.stop_token_ids else None)
        elif n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        text = self._text[req.request_id]
        delta, matched = text.add(tok, last=reason is not None)
        if matched is not None:
            reason, stop_reason = "stop", matched
        out = RequestOutput(req.request_id, [tok], delta, logprobs=None if lp is None else [lp])
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True
            out.prompt_logprobs = [None, *req.prompt_logprobs]
        if reason is not None:
            self._finish(req, reason, stop_reason, out)
        return out

    def _finish(
        self, req: Request, reason: str, stop_reason: str | int | None, out: RequestOutput
    ) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        if req.params.lora_name is not None and self.runner.lora is not None:
            self.runner.lora.release(req.params.lora_name)
        self._text.pop(req.request_id, None)
        self.sampler.forget(req.request_id)
        self.guides.forget(req.request_id)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        self.counters.requests_finished += 1
        out.finished = True
        out.finish_reason = reason
        out.stop_reason = stop_reason
        out.num_prompt_tokens = req.num_prompt_tokens
        out.num_cached_tokens = req.num_cached_tokens
        out.num_output_tokens = len(req.output_token_ids)
        if req.request_id in self.scheduler.held:
            out.held_block_ids = list(req.block_ids)
        out.arrival_time = req.arrival_time
        out.first_scheduled_time = req.first_scheduled_time
        out.first_token_time = req.first_token_time

    # -- control ---------------------------------------------------------------------------
    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a queued or running request (its final delta), and free the blocks of a
        finished request held for a transfer (then None is returned: it has no stream)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            self.scheduler.release(request_id)
            return None
        text = self._text.get(request_id)
        out = RequestOutput(request_id, [], text.finish() if text else "")
        self._finish(req, "abort", None, out)
        return out

    def release(self, request_id: str) -> bool:
        """Prefill node: free a held request's blocks (pulled, or its lease ran out)."""
        return self.scheduler.release(request_id)

    def release_held(self, request_id: str, block_ids: list[int] | None = None) -> int | None:
        """Prefill node: free a held request's blocks if `block_ids` (when given) are exactly
        them. Returns how many were freed, None if nothing is held; raises RequestError (and
        frees nothing) when the ids are not that request's."""
        req = self.scheduler.held.get(request_id)
        if req is None:
            return None
        if block_ids is not None and list(block_ids) != req.block_ids:
            raise RequestError(f"block ids {block_ids} do not belong to request {request_id!r}")
        n = len(req.block_ids)
        self.scheduler.release(request_id)
        return n

    def kv_ready(
        self,
        request_id: str,
        ok: bool,
        quarantine: bool = False,
        digests: list[int | None] | None = None,
        where: str = "transfer",
        hashed: Mapping[int, BytesHash] | None = None,
    ) -> KVCheck:
        """The transfer for a reserved request finished (ok) or failed; with `quarantine` its
        target blocks are set aside until `release_quarantine`. With `digests` (the sender's,
        aligned with the request's blocks; None for a block not transferred) the KV counts only
        as far as it matches them (`where` names the source in the counters); `hashed` holds
        the blocks' bytes hashed as they landed, bound and checked here instead of hashing
        the blocks again."""
        return self.scheduler.kv_ready(request_id, ok, quarantine, digests, where, hashed)[1]

    def share(
        self, share_id: str, hashes: list[int], cache_salt: str | None, lease_s: float
    ) -> tuple[list[int], list[int]]:
        """Any node: hold the leading blocks of `hashes` (the prefix of a prompt of domain
        `cache_salt`) that this node has, for a peer's pull; with their digests."""
        s = self.scheduler
        if share_id in s.held or share_id in s.requests:
            raise RequestError(f"share id {share_id!r} is a request's")
        try:
            return s.shares.share(
                share_id, hashes, domain_root(cache_salt, self.config.hash_seed), lease_s
            )
        except ValueError as e:
            raise RequestError(str(e)) from None

    def release_share(self, share_id: str) -> bool:
        return self.scheduler.shares.release(share_id)

    def release_quarantine(self, request_id: str) -> int:
        """Decode node: the failed transfer of `request_id` is over: free its blocks."""
        return self.kv.release_quarantine(request_id)

    def request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id) or self.scheduler.held.get(request_id)

    def held_blocks(self, request_id: str) -> list[int] | None:
        """Prefill node: the blocks held for `request_id`, or None if it holds none."""
        req = self.scheduler.held.get(request_id)
        return None if req is None else list(req.block_ids)

    def held_kv(self, request_id: str) -> tuple[list[int], list[int] | None] | None:
        """Prefill node: the blocks held for `request_id` and their content digests (taken when
        the hold began), or None if it holds none."""
        req = self.scheduler.held.get(request_id)
        return None if req is None else (list(req.block_ids), req.held_digests)

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "num_requests_held": len(self.scheduler.held),
            "num_waiting_tokens": self.scheduler.num_waiting_tokens,
            # prompt tokens still to prefill, running requests' remainders included (the
            # coordinator's routing cost; node/engines/native.py `_drain` reports the same)
            "queued_prefill_tokens": self.scheduler.queued_prefill_tokens(),
            "queue_full": float(self.queue_full()),
            "num_requests_rejected_queue_full": self.counters.requests_rejected_queue_full,
            "num_requests_failed": self.counters.requests_failed,
            "kv_blocks_quarantined": self.kv.num_quarantined,
            "kv_cache_usage_perc": self.pool.usage,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_retained": len(self.retention),
            **{f"kv_digest_checks_{k}": v for k, v in self.kv.checks.items()},
            **{f"kv_digest_mismatches_{k}": v for k, v in self.kv.mismatches.items()},
            **{f"kv_reused_tokens_{k}": v for k, v in self.kv.reused.items()},
            "kv_reuse_queries": self.kv.reuse_queries,
            **(self.tiers.stats() if self.tiers is not None else {}),
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "prompt_tokens_computed": self.counters.prompt_tokens_computed,
            "prompt_tokens_cached": self.kv.prefix_hits,
            "generation_tokens": self.counters.generation_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "steps": self.counters.steps,
            **self.residency_stats(),
            **(self.speculator.counters.stats() if self.speculator is not None else {}),
        }
