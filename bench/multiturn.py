"""`duet bench serve --workload multi-turn`: conversations whose history grows turn by turn.

Each team (`--team`, or one team without) has its own system prompt of `--system-prompt-len`
tokens, shared by all its conversations. A conversation sends `--turns` requests: the first is
the system prompt and a user message of `--input-len` tokens; each next one is the whole
history so far — every earlier user message and the answer the server gave to it — plus a new
user message, after a think time drawn from an exponential of mean `--think-time-s`. `--users`
conversations are in flight at once (a closed loop: a user starts its next conversation when
one ends), until `--conversations` have run, `--num-requests` turns were sent or `--duration`
passed. A turn refused for lack of capacity (503, 429) is sent again a second later, as a chat
client would retry it; each refusal is recorded (and reported) as the failure it is. What a server
can reuse is exactly what a chat client resends: the system prompt across a team, and a
conversation's history across its turns; the working set (every conversation's final history, and
the system prompts) is reported, to be sized against the cluster's KV memory.

Forms: the chat endpoint sends `messages` (system, then user and assistant turns), which the
server templates; /v1/completions sends the history as one text (`--prompt-format text`) or as
token ids (`tokens`: each answer re-encoded by the tokenizer, as a client holding only text
would). Invariant: the conversations (their teams, messages, lengths and think times) are a
pure function of the config and seed; only the answers come from the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench import payload, sse_client
from bench.loadgen import OnDone, RunOutcome
from bench.mix import Mixer
from bench.prompts import PromptBuilder
from bench.records import RequestRecord
from bench.serve_config import ServeConfig
from bench.workloads import BenchRequest

#: a turn the server refused for lack of capacity is sent again after this long, this often
RETRY_AFTER_S = 1.0
MAX_RETRIES = 30
_RETRIED = ("http_503", "http_429")


@dataclass
class Conversation:
    index: int
    team: str | None
    key: str | None
    tier: str | None
    system: list[int]
    #: each turn's user message (ids), answer length and think time before it
    users: list[list[int]]
    output_lens: list[int]
    think_s: list[float]
    #: the answers so far (text, as the server sent it)
    answers: list[str] = field(default_factory=list)


def _think(rng: random.Random, mean_s: float) -> float:
    return rng.expovariate(1 / mean_s) if mean_s > 0 else 0.0


def plan(cfg: ServeConfig, builder: PromptBuilder) -> list[Conversation]:
    """The run's conversations, from the config and seed alone."""
    rng, mixer = random.Random(cfg.seed), Mixer(cfg, cfg.seed + 1)
    mt = cfg.multi_turn
    systems: dict[str | None, list[int]] = {}
    out = []
    for i in range(mt.conversations):
        team, key, tier = mixer.draw()
        if team not in systems:
            systems[team] = builder.random_ids(rng, mt.system_prompt_len)
        turns = mt.turns
        out.append(
            Conversation(
                index=i,
                team=team,
                key=key,
                tier=tier,
                system=systems[team],
                users=[builder.random_ids(rng, cfg.input_len.sample(rng)) for _ in range(turns)],
                output_lens=[cfg.output_len.sample(rng) for _ in range(turns)],
                think_s=[0.0] + [_think(rng, mt.think_time_s) for _ in range(turns - 1)],
            )
        )
    return out


def _text(builder: PromptBuilder, ids: list[int]) -> str:
    assert builder.tokenizer is not None
    return builder.tokenizer.decode(ids)


def _prompt(cfg: ServeConfig, builder: PromptBuilder, c: Conversation, turn: int) -> Any:
    """Turn `turn`'s prompt: the history so far and the new user message, in the form sent."""
    if cfg.chat:
        msgs = [{"role": "system", "content": _text(builder, c.system)}]
        for t in range(turn + 1):
            msgs.append({"role": "user", "content": _text(builder, c.users[t])})
            if t < turn:
                msgs.append({"role": "assistant", "content": c.answers[t]})
        return msgs
    if builder.fmt == "text":
        parts = [_text(builder, c.system)]
        for t in range(turn + 1):
            parts.append(_text(builder, c.users[t]))
            if t < turn:
                parts.append(c.answers[t])
        return "\n".join(parts)
    ids = list(c.system)
    for t in range(turn + 1):
        ids += c.users[t]
        if t < turn:
            ids += builder.encode_text(c.answers[t])
    return ids


def _body(cfg: ServeConfig, builder: PromptBuilder, c: Conversation, turn: int) -> dict[str, Any]:
    prompt = _prompt(cfg, builder, c, turn)
    req = BenchRequest(
        prompt="" if cfg.chat else prompt, prompt_len=0, output_len=c.output_lens[turn]
    )
    b = payload.body(cfg, req, c.tier)
    if cfg.chat:
        b["messages"] = prompt
    return b


class _Runner:
    """One multi-turn run: its clock, its records, and the conversations' histories."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        cfg: ServeConfig,
        builder: PromptBuilder,
        on_done: OnDone | None,
        stop: asyncio.Event,
    ) -> None:
        self.session, self.cfg, self.builder, self.on_done, self.stop = (
            session,
            cfg,
            builder,
            on_done,
            stop,
        )
        self.records: list[RequestRecord] = []
        self.run_id, self.started_at, self.start = uuid.uuid4().hex[:8], time.time(), 0.0
        #: conversation → tokens of its last answered turn (prompt and answer)
        self.last: dict[int, int] = {}

    def over(self) -> bool:
        cfg = self.cfg
        sent_all = cfg.num_requests is not None and len(self.records) >= cfg.num_requests
        late = cfg.duration_s is not None and time.perf_counter() - self.start >= cfg.duration_s
        return self.stop.is_set() or sent_all or late

    async def send_turn(self, c: Conversation, turn: int) -> RequestRecord:
        """One turn; refused for lack of capacity (503, 429) it is sent again after
        RETRY_AFTER_S, as a client would, each refusal recorded as the failure it is."""
        cfg = self.cfg
        body = _body(cfg, self.builder, c, turn)
        for attempt in range(MAX_RETRIES + 1):
            rec = RequestRecord(
                index=len(self.records),
                prompt_len=0,
                max_tokens=c.output_lens[turn],
                scheduled_s=time.perf_counter() - self.start,
                team=c.team,
                tier=c.tier,
                group=c.index,
                turn=turn,
            )
            rec.text = ""
            self.records.append(rec)
            rid = f"bench-{self.run_id}-{c.index}-{turn}" + (f"-r{attempt}" if attempt else "")
            headers = payload.headers(cfg, c.key, c.tier, rid)
            await sse_client.send(
                self.session, cfg.url, body, headers, rec, cfg.request_timeout, self.start
            )
            if self.on_done is not None:
                self.on_done(rec)
            if rec.ok or rec.cause not in _RETRIED or self.over():
                return rec
            rec.text = None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RETRY_AFTER_S):
                    await self.stop.wait()
        return rec

    async def converse(self, c: Conversation) -> None:
        for turn in range(self.cfg.multi_turn.turns):
            if c.think_s[turn]:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(c.think_s[turn]):
                        await self.stop.wait()
            if self.over():
                return
            rec = await self.send_turn(c, turn)
            if not rec.ok:
                return  # a conversation whose turn failed ends: its history is not known
            c.answers.append(rec.text or "")
            rec.prompt_len = rec.usage_prompt_tokens or 0
            self.last[c.index] = rec.prompt_len + rec.output_tokens
            rec.text = None

    async def run(self, convs: list[Conversation]) -> RunOutcome:
        queue = list(reversed(convs))

        async def user() -> None:
            while queue and not self.over():
                await self.converse(queue.pop())

        self.start = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(self.cfg.multi_turn.users)))
        return RunOutcome(
            records=self.records,
            duration_s=time.perf_counter() - self.start,
            started_at=self.started_at,
            interrupted=self.stop.is_set(),
        )


async def run_multiturn(
    session: aiohttp.ClientSession,
    cfg: ServeConfig,
    builder: PromptBuilder,
    on_done: OnDone | None = None,
    stop: asyncio.Event | None = None,
) -> tuple[RunOutcome, dict[str, Any]]:
    """Run the conversations; returns the outcome and the workload's own figures."""
    convs = plan(cfg, builder)
    runner = _Runner(session, cfg, builder, on_done, stop or asyncio.Event())
    outcome = await runner.run(convs)
    mt, last = cfg.multi_turn, runner.last
    systems = {c.team: len(c.system) for c in convs}
    figures = {
        "conversations": len(last),
        "turns": mt.turns,
        "users": mt.users,
        "system_prompt_len": mt.system_prompt_len,
        "think_time_s": mt.think_time_s,
        # every conversation's final history beyond its system prompt, and each system prompt
        # once: the KV a cache would hold to serve every turn from cache
        "working_set_tokens": sum(last.values())
        - sum(systems[convs[i].team] for i in last)
        + sum(systems.values()),
    }
    return outcome, figures
