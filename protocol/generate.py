"""vLLM's token-in/token-out wire: `POST /inference/v1/generate` and the render endpoints'
answers (`/v1/chat/completions/render`, `/v1/completions/render`), in vLLM's field names.

A router or an RL trainer renders a prompt once (render: the model's chat template and
tokenizer → token ids), then sends token ids and gets token ids and their logprobs back, with no
text in between to re-tokenize. `GenerateRequest` is what it sends; a render answer is a
`GenerateRequest` ready to send (vLLM's shape: its `token_ids` and `sampling_params`).

Only what duet serves is taken: an unknown field, or one of vLLM's that duet does not serve set
to anything but its neutral value, is a 400 naming it (gateway/api/tokens.py), never ignored.
"""

from __future__ import annotations

import math
import re

import msgspec

from protocol.logprobs import TokenLogprob
from protocol.openai import APIError, CompletionLogprobs, StreamOptions, Usage
from protocol.structured import StructuredOutputs

#: text-only sampling switches: the answer is token ids, so they change nothing
TEXT_ONLY = ("skip_special_tokens", "spaces_between_special_tokens", "detokenize")


class GenerateSamplingParams(
    msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """vLLM's `sampling_params` of a generate request (unset: the model's default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    #: -1 (vLLM's "off") or positive
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: list[str] | None = None
    n: int | None = None
    #: the sampled token's logprob plus this many top tokens (0..20)
    logprobs: int | None = None
    #: the constraint on the answer (vLLM's form; a render answer carries the body's)
    structured_outputs: StructuredOutputs | None = None
    #: text-only switches: the answer is token ids, so they change nothing
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    detokenize: bool | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """`POST /inference/v1/generate`'s body (vLLM's `GenerateRequest`)."""

    token_ids: list[int]
    sampling_params: GenerateSamplingParams
    #: the gateway serves several models: required there; a node serves one (None: it)
    model: str | None = None
    request_id: str | None = None
    #: the answer as SSE: one `GenerateChunk` per step (its new token ids), then `[DONE]`
    stream: bool | None = False
    #: `include_usage`: a last chunk with no choices carries the usage (vLLM: off by default)
    stream_options: StreamOptions | None = None
    #: the answer carries the prompt's ids as `prompt_token_ids` (streamed: the first event)
    return_token_ids: bool | None = None
    #: vLLM's answer level: "tokens" (ids and logprobs by id) is served, "text" is a 400
    output_mode: str = "tokens"
    #: vLLM's fields duet does not serve: taken only at their neutral value (the gateway salts
    #: the prefix cache per team itself, schedules by tier, and moves KV between its own nodes)
    cache_salt: str | None = None
    priority: int = 0
    features: str | None = None
    kv_transfer_params: dict[str, str] | None = None


class GenerateLogprob(msgspec.Struct, kw_only=True):
    """One (token, logprob) candidate by token id (vLLM's `GenerateLogProb`)."""

    token_id: int
    logprob: float
    #: its rank in the vocabulary (1: the likeliest); None where the engine did not say
    rank: int | None = None


class GenerateLogprobsContent(GenerateLogprob, kw_only=True):
    """The sampled token at one position and the candidates there (vLLM's
    `GenerateLogProbsContent`): the sampled token first, then the top tokens by rank, as many
    as asked (at least one)."""

    top_logprobs: list[GenerateLogprob] = []


class GenerateLogprobs(msgspec.Struct, kw_only=True):
    """One choice's logprobs, one entry per generated token (vLLM's `GenerateLogProbs`)."""

    content: list[GenerateLogprobsContent] | None = None


def _floor(x: float) -> float:
    # vLLM's floor for a logprob JSON cannot carry (-inf, NaN)
    return -9999.0 if math.isnan(x) else max(x, -9999.0)


def generate_logprobs(records: list[TokenLogprob]) -> GenerateLogprobs:
    """The engine's records (`top` as many as asked) in vLLM's token-id form, built as vLLM's
    server builds it: per position the sampled token, then the top tokens ranked 1.. — one
    entry per id, where it first came, with its last value (a sampled token among the top
    takes its top rank) — cut to max(asked, 1)."""
    content: list[GenerateLogprobsContent] = []
    for r in records:
        seen: dict[int, tuple[float, int | None]] = {r.token_id: (r.logprob, r.rank)}
        for i, (t, lp) in enumerate(r.top):
            seen[t] = (lp, i + 1)
        lp, rank = seen[r.token_id]
        content.append(
            GenerateLogprobsContent(
                token_id=r.token_id,
                logprob=_floor(lp),
                rank=rank or None,
                top_logprobs=[
                    GenerateLogprob(token_id=t, logprob=_floor(v), rank=k or None)
                    for t, (v, k) in list(seen.items())[: max(len(r.top), 1)]
                ],
            )
        )
    return GenerateLogprobs(content=content)


def choice_logprobs(lp: CompletionLogprobs | None) -> GenerateLogprobs | None:
    """A node answer's logprobs (asked with `logprob_records`) in vLLM's token-id form."""
    if lp is None:
        return None
    assert lp.records is not None, "the leg was not asked for logprob_records"
    return generate_logprobs(lp.records)


class GenerateChoice(msgspec.Struct, kw_only=True):
    """One sample: its token ids, their logprobs when asked (vLLM's token-id form)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: GenerateLogprobs | None = None


class GenerateResponse(msgspec.Struct, kw_only=True, tag_field="output_mode", tag="tokens"):
    """`/inference/v1/generate`'s answer (vLLM's `GenerateTokensResponse`: `output_mode`
    "tokens", the tag msgspec writes on every answer)."""

    request_id: str
    model: str
    created: int
    choices: list[GenerateChoice]
    usage: Usage
    prompt_logprobs: None = None
    #: with `return_token_ids`: the prompt's ids
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: None = None


class GenerateChunk(
    msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="output_mode", tag="tokens"
):
    """One event of a streamed generate answer (vLLM's `GenerateTokensStreamResponse`, its
    `output_mode` tag on each): a choice's new token ids (their logprobs when asked, its finish
    reason on its last), or, last, the usage with no choices."""

    request_id: str
    choices: list[GenerateChoice]
    usage: Usage | None = None
    #: with `return_token_ids`, on the first event only: the prompt's ids
    prompt_token_ids: list[int] | None = None


class Rendered(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A render endpoint's answer for one prompt: the generate request that serves it."""

    token_ids: list[int]
    sampling_params: GenerateSamplingParams
    model: str
    stream: bool = False


def parse_generate(raw: bytes) -> GenerateRequest:
    """A generate body, type-checked (a 400 naming the field as the body nests it:
    `sampling_params.top_k`), with vLLM's fields duet does not serve refused unless neutral."""
    try:
        body = msgspec.json.decode(raw, type=GenerateRequest)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request: {e}", param=_param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    if body.output_mode != "tokens":
        raise APIError(
            400,
            f"output_mode {body.output_mode!r} is not served here: only 'tokens' (token ids and "
            "their logprobs by id; /v1/completions answers the same request as text)",
            param="output_mode",
            code="unsupported_field",
        )
    for name, neutral in (("cache_salt", None), ("priority", 0), ("features", None)):
        if getattr(body, name) != neutral:
            raise APIError(
                400,
                f"{name} is not supported here (duet salts each team's prefix cache, "
                "schedules by tier and moves KV between its own nodes itself)",
                param=name,
                code="unsupported_field",
            )
    if body.kv_transfer_params:
        raise APIError(
            400,
            "kv_transfer_params is not supported here (duet moves KV between its nodes itself)",
            param="kv_transfer_params",
            code="unsupported_field",
        )
    return body


def sampling_kwargs(
    sp: GenerateSamplingParams,
) -> dict[str, int | float | bool | list[str] | StructuredOutputs]:
    """The sampling fields a client set, by the names OpenAI's completions form gives them
    (the same names), vLLM's top_k -1 ("off") as unset; the text-only switches left out."""
    out = {
        f: v
        for f in GenerateSamplingParams.__struct_fields__
        if f not in TEXT_ONLY and (v := getattr(sp, f)) is not None
    }
    if out.get("top_k") == -1:
        del out["top_k"]
    return out


def _param_of(msg: str) -> str | None:
    """The field a msgspec validation message names, dotted from the body's root
    (`sampling_params.top_k`), or None."""
    at = msg.rsplit("`$.", 1)[1].rstrip("`").split("[")[0] if "`$." in msg else ""
    named = re.search(r"(?:missing required|unknown) field `([^`]+)`", msg)
    if named is None:
        return at or None
    return f"{at}.{named[1]}" if at else named[1]
