"""The sampling limits every process enforces, and the words it refuses with.

One home for each rule: the gateway (gateway/serving/requests.py), the request bodies of
protocol/openai.py (which the nodes decode) and the engine's `SamplingParams` check the same
ranges here, so a request refused anywhere is refused with the same message and names the same
field. Ranges are OpenAI's where OpenAI has one (temperature 0..2, top_p (0, 1], n ≤ 8, four
stop strings, penalties -2..2, logit_bias ±100 over 300 token ids, 20 top logprobs) and vLLM's
for its extensions (top_k, min_tokens, repetition_penalty in [0.01, 100], min_p in [0, 1]).

A failed check raises `LimitError`, a ValueError carrying the field (`param`): the HTTP layers
turn it into a 400 with OpenAI's error body (`protocol.openai.refused`), the engine lets it
rise as the ValueError it is. Non-finite numbers fail every range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from protocol.logprobs import MAX_TOP_LOGPROBS

#: OpenAI's temperature range is [0, TEMPERATURE_MAX]
TEMPERATURE_MAX = 2.0
#: samples one request may ask for
MAX_N = 8
#: stop strings one request may give, and the characters of each: the engine holds back the
#: longest stop's length of text and searches it for every stop at every token, so 4 stops of
#: 100k characters cost a node's step 400k comparisons per request (common servers cap at 1,024)
MAX_STOP = 4
MAX_STOP_CHARS = 1024
#: frequency and presence penalties lie in [-PENALTY_RANGE, PENALTY_RANGE]
PENALTY_RANGE = 2.0
#: token ids one logit_bias may name, and the bound of each bias
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0
#: digits of a logit_bias key: every vocabulary's ids fit, and a longer key is refused before
#: `int()` spends time on it (or raises past Python's digit limit, a 500 and a traceback)
MAX_TOKEN_ID_DIGITS = 10
#: vLLM's repetition_penalty only asks > 0, but dividing a logit by 1e-38 made it infinite and
#: the row's softmax NaN, after the whole prompt was computed: bounded to what a model's fp32
#: logits bear (100x either way; 1 is off)
REPETITION_PENALTY_RANGE = (0.01, 100.0)

__all__ = [
    "LOGIT_BIAS_RANGE",
    "MAX_LOGIT_BIAS",
    "MAX_N",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_TOKEN_ID_DIGITS",
    "MAX_TOP_LOGPROBS",
    "PENALTY_RANGE",
    "REPETITION_PENALTY_RANGE",
    "TEMPERATURE_MAX",
    "LimitError",
    "check_bias_values",
    "check_logprobs",
    "check_max_tokens",
    "check_min_tokens",
    "check_n",
    "check_penalties",
    "check_stop",
    "check_temperature",
    "check_top_k",
    "check_top_p",
    "logit_bias",
    "max_context",
    "over_context",
]


class LimitError(ValueError):
    """A field out of its range: `param` names it, the message says the range."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _finite_in(v: float, low: float, high: float) -> bool:
    return math.isfinite(v) and low <= v <= high


def check_max_tokens(v: int | None) -> None:
    if v is not None and v < 1:
        raise LimitError("max_tokens", f"max_tokens must be at least 1, got {v}")


def check_temperature(v: float | None) -> None:
    if v is not None and not _finite_in(v, 0.0, TEMPERATURE_MAX):
        raise LimitError("temperature", f"temperature must be between 0 and 2, got {v}")


def check_top_p(v: float | None) -> None:
    if v is not None and not (math.isfinite(v) and 0 < v <= 1):
        raise LimitError("top_p", f"top_p must be in (0, 1], got {v}")


def check_n(n: int) -> None:
    if not 1 <= n <= MAX_N:
        raise LimitError("n", f"n must be between 1 and {MAX_N}, got {n}")


def check_top_k(v: int | None) -> None:
    if v is not None and v < -1:
        raise LimitError("top_k", "top_k must be -1 (off) or positive")


def check_min_tokens(v: int | None) -> None:
    if v is not None and v < 0:
        raise LimitError("min_tokens", "min_tokens must be >= 0")


def check_stop(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise LimitError("stop", f"stop takes up to {MAX_STOP} non-empty strings")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise LimitError(
            "stop",
            f"each stop string may be at most {MAX_STOP_CHARS} characters, got one of {longest}",
        )


def check_logprobs(name: str, n: int | None) -> None:
    """`logprobs` (completions) or `top_logprobs` (chat): how many top tokens, 0..20."""
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise LimitError(name, f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {n}")


def check_penalties(
    frequency: float | None, presence: float | None, repetition: float | None, min_p: float | None
) -> None:
    """OpenAI's penalties in [-2, 2], vLLM's repetition_penalty in REPETITION_PENALTY_RANGE and
    min_p in [0, 1]."""
    for name, v in (("frequency_penalty", frequency), ("presence_penalty", presence)):
        if v is not None and not _finite_in(v, -PENALTY_RANGE, PENALTY_RANGE):
            raise LimitError(name, f"{name} must be between -2 and 2, got {v}")
    low, high = REPETITION_PENALTY_RANGE
    if repetition is not None and not _finite_in(repetition, low, high):
        raise LimitError(
            "repetition_penalty",
            f"repetition_penalty must be between {low:g} and {high:g}, got {repetition}",
        )
    if min_p is not None and not _finite_in(min_p, 0.0, 1.0):
        raise LimitError("min_p", f"min_p must be between 0 and 1, got {min_p}")


def _bias_count(n: int) -> None:
    if n > MAX_LOGIT_BIAS:
        raise LimitError(
            "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {n}"
        )


def _bias_value(token: object, v: float) -> None:
    if not _finite_in(v, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE):
        raise LimitError(
            "logit_bias",
            f"logit_bias values must be between -100 and 100, got {v} for token {token}",
        )


def check_bias_values(bias: Mapping[int, float]) -> None:
    """The engine's logit_bias (token id → bias): its size and its values."""
    _bias_count(len(bias))
    for k, v in bias.items():
        _bias_value(k, v)


def logit_bias(bias: Mapping[str, float] | None) -> dict[str, float] | None:
    """A wire logit_bias checked, its keys canonical token ids ("007" → "7"); None when empty.
    The vocabulary's bound is the model's, checked where the tokenizer is known."""
    if not bias:
        return None
    _bias_count(len(bias))
    out: dict[str, float] = {}
    for k, v in bias.items():
        if not k.isdecimal() or not k.isascii():
            raise LimitError(
                "logit_bias",
                f"logit_bias keys must be token ids (non-negative integers as strings), got {k!r}",
            )
        if len(k) > MAX_TOKEN_ID_DIGITS:
            raise LimitError(
                "logit_bias",
                f"logit_bias keys are token ids of at most {MAX_TOKEN_ID_DIGITS} digits, "
                f"got one of {len(k)}",
            )
        _bias_value(k, v)
        out[str(int(k))] = float(v)
    return out


def max_context(limit: int) -> str:
    """The words every refusal of a too-long prompt starts from."""
    return f"this model's maximum context length is {limit} tokens"


def over_context(limit: int, prompt: int, completion: int) -> str:
    """A prompt plus its completion that do not fit the model's context."""
    return (
        f"{max_context(limit)}, but {prompt + completion} were requested ({prompt} in the "
        f"prompt, {completion} for the completion)"
    )
