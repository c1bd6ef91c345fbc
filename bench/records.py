"""What `duet bench serve` keeps about each request it sent: the plan (scheduled send time,
prompt and output lengths, team and tier) and what happened (send time, the arrival time of
every streamed content chunk, usage, and on failure its cause).

Invariants: times are seconds; `scheduled_s` and `sent_s` are offsets from the start of the
measured run, `chunk_s` offsets from this request's own send; `ok` is True only for a stream
that ended with `[DONE]` after at least one content chunk; a failed record has `cause` set to
one of CAUSES or `http_<status>`.
"""

from __future__ import annotations

import itertools
from types import MappingProxyType

import msgspec

#: failure causes other than `http_<status>`
CAUSES = MappingProxyType(
    {
        "timeout": "no complete answer within --request-timeout",
        "connection_error": "could not connect, or the connection dropped before a response",
        "sse_error": "the stream carried an error event",
        "incomplete_stream": "the stream ended (or the connection dropped) before [DONE]",
        "no_output": "the stream finished without a single content token",
        "bad_response": "the answer was not OpenAI-shaped SSE",
        "client_error": "the request could not be sent (see the message)",
    }
)


class RequestRecord(msgspec.Struct, kw_only=True):
    index: int
    prompt_len: int
    max_tokens: int
    scheduled_s: float
    team: str | None = None
    tier: str | None = None
    group: int | None = None
    #: tokens the prompt shares with its group's prefix, as sent (None: no group)
    prefix_tokens: int | None = None
    #: multi-turn: the turn of its conversation (0 first; `group` is the conversation)
    turn: int | None = None
    #: the streamed answer's text, kept only while a multi-turn run needs it (None: not kept)
    text: str | None = None
    sent_s: float = 0.0
    ok: bool = False
    cause: str | None = None
    message: str = ""
    ttft_s: float | None = None
    e2el_s: float = 0.0
    #: arrival of each content chunk, seconds after the send
    chunk_s: list[float] = msgspec.field(default_factory=list)
    #: tokens carried by each content chunk (token_ids when the server sends them, else 1)
    chunk_tokens: list[int] = msgspec.field(default_factory=list)
    output_tokens: int = 0
    #: True when output_tokens came from the final usage chunk, False when counted from chunks
    usage_tokens: bool = False
    usage_prompt_tokens: int | None = None
    cached_tokens: int | None = None

    def fail(self, cause: str, message: str = "") -> None:
        self.ok = False
        self.cause = cause
        self.message = message[:500]

    @property
    def itl_s(self) -> list[float]:
        c = self.chunk_s
        return [b - a for a, b in itertools.pairwise(c)]

    @property
    def tpot_s(self) -> float | None:
        """(E2EL − TTFT) / (output tokens − 1); None for outputs of one token."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)
