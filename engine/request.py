"""A request's state inside the engine: tokens, progress, blocks, status.

Invariants: `num_computed_tokens <= len(all_token_ids)`; KV for positions
`[0, num_computed_tokens)` is in this request's blocks (`block_ids`, in order); a finished
request holds no blocks unless it is held for a transfer (`held`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from protocol.logprobs import TokenLogprob
from protocol.sampling import Priority, SamplingParams

__all__ = ["Priority", "Request", "Status"]


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    #: prompt tokens served from the prefix cache at the last admission
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    #: keep blocks after finishing (prefill node: held until a decode node has pulled them)
    hold_blocks: bool = False
    #: prefill node: seconds the held blocks wait for a pull (None: until released)
    hold_seconds: float | None = None
    #: monotonic time a held request's blocks are freed on their own (set when it finishes)
    hold_expiry: float | None = None
    #: decode node: number of prompt tokens whose KV arrives from a remote prefill node (or, on
    #: any node, a prefix pulled from a peer)
    remote_num_tokens: int = 0
    #: prefill node: the content digests of the held blocks (protocol/kv_digest.py), for the
    #: node that pulls them; None without digests
    held_digests: list[int] | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    #: prompt logprobs gathered so far (positions 1.. of the prompt; see `needs_prompt_logprobs`)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: whether the gathered prompt logprobs went out (on the first generated token's delta)
    prompt_logprobs_sent: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some prompt positions lack them (such a request
        skips the prefix cache: a cached block has no logits)."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def sort_key(self) -> tuple[int, float]:
        return (int(self.priority), self.arrival_time)
