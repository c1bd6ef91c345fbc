"""How big a request is on one model: its prompt's token ids (the model's tokenizer and chat
template), the prompt tokens to reserve for, and the max_tokens that fit the context.

A self-hosted model counts exactly. An external model has no local tokenizer: its provider
counts, so the reservation holds on an upper bound that cannot be too low — the prompt's UTF-8
bytes, since a byte-level BPE token covers at least one byte (`token_upper_bound`; a budget
held on "one token per 3 characters" was overspent 2.4× by CJK text, which providers bill at
about one token per character). `estimate_tokens`, a realistic figure, only helps `auto` pick
a model. Prompts over `_BIG_PROMPT` characters (tools and tool calls counted) are tokenized
off the loop; one that cannot fit the context by its characters alone is refused before
(`check_chars`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from gateway.backends.base import ServedModel
from gateway.serving.requests import Request
from gateway.serving.retain import retain_for
from gateway.tools.plan import ToolPlan, plan_for
from gateway.tools.prompt import render
from protocol.limits import over_context
from protocol.openai import APIError
from protocol.retention import KVRetain
from text.guide_compile import GuideChecker
from text.tokenizer import ChatTemplateError, Tokenizer

#: prompts longer than this (characters) are tokenized off the event loop
_BIG_PROMPT = 16_384


@dataclass(frozen=True)
class Measured:
    #: the prompt's token ids on the model ([] for an external model)
    ids: list[int]
    #: prompt tokens to reserve for: len(ids), or an external model's estimate
    n_prompt: int
    max_tokens: int
    #: how the model takes the request's tools (self-hosted chat with tools or tool turns)
    tools: ToolPlan | None = None
    #: embeddings: each input's token ids (`ids` stays empty: there is no one prompt)
    inputs: list[list[int]] = field(default_factory=list)
    #: the prompt prefix the nodes keep for the client (its `cache_control`); None: none
    retain: KVRetain | None = None


def tool_plan(served: ServedModel, req: Request) -> ToolPlan | None:
    """The request's tools on a self-hosted model (None: no tools, or the provider's model)."""
    if (
        served.tokenizer is None
        or req.messages is None
        or (req.tools.choice == "none" and not req.has_tool_turns)
    ):
        return None
    return plan_for(
        req.tools,
        served.config.tool_parser,
        served.tokenizer.chat_template,
        served.config.closed_objects,
    )


def _chat_ids(tok: Tokenizer, req: Request, plan: ToolPlan | None) -> list[int]:
    assert req.messages is not None
    if plan is None:
        return tok.encode_chat(req.messages)
    return tok.encode(render(tok, req.messages, plan), add_special_tokens=False)


def check_logit_bias(tok: Tokenizer, req: Request) -> None:
    """logit_bias names token ids of this model's vocabulary."""
    bad = [k for k in req.sampling.logit_bias or () if int(k) >= tok.vocab_size]
    if bad:
        raise APIError(
            400,
            f"logit_bias names token ids out of the vocabulary (size {tok.vocab_size}): {bad[:5]}",
            param="logit_bias",
        )


def render_size(req: Request) -> int:
    """About the characters a chat's template renders: the messages' text and, beside it, the
    tool definitions and a tool turn's calls (4 MiB of tool schemas beside a one-character
    message is as big a prompt as 4 MiB of text)."""
    assert req.messages is not None
    return sum(len(m["content"]) for m in req.messages) + _beside_text_bytes(req)


def check_chars(served: ServedModel, tok: Tokenizer, req: Request) -> None:
    """400 `context_length_exceeded` for a prompt whose text alone is more characters than the
    model's context can hold in tokens (`Tokenizer.max_token_chars` per token), before the
    tokenizer spends CPU on it. Only text every template renders counts (the prompt, the
    users' turns), so the refusal is certain: a prompt it passes may still be too long."""
    if req.messages is not None:
        chars, param = (
            sum(len(m["content"]) for m in req.messages if m.get("role") == "user"),
            "messages",
        )
    elif isinstance(req.prompt, str):
        chars, param = len(req.prompt), "prompt"
    else:
        return
    most = served.max_model_len * tok.max_token_chars
    if chars > most:
        raise APIError(
            400,
            f"this model's maximum context length is {served.max_model_len} tokens, at most "
            f"{most} characters of text; the prompt has {chars} characters",
            param=param,
            code="context_length_exceeded",
        )


async def prompt_ids(served: ServedModel, req: Request, plan: ToolPlan | None = None) -> list[int]:
    tok = served.tokenizer
    if tok is None:
        return []
    check_logit_bias(tok, req)
    check_chars(served, tok, req)
    try:
        if req.messages is not None:
            size = render_size(req)
            enc = lambda: _chat_ids(tok, req, plan)  # noqa: E731
        elif isinstance(req.prompt, str):
            text = req.prompt
            size = len(text)
            enc = lambda: tok.encode(text)  # noqa: E731
        else:
            ids = list(req.prompt or [])
            bad = [t for t in ids if not 0 <= t < tok.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"prompt token ids out of the vocabulary (size {tok.vocab_size}): {bad[:5]}",
                    param="prompt",
                )
            return ids
        return await asyncio.to_thread(enc) if size > _BIG_PROMPT else enc()
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


def estimate_tokens(req: Request) -> int:
    """Prompt tokens of a request no local tokenizer can count (external models): one token
    per 3 characters over-counts English for common tokenizers, so the reservation holds."""
    if req.messages is not None:
        return sum(len(m["content"]) // 3 + 4 for m in req.messages) + 3
    return len(req.prompt) if isinstance(req.prompt, list) else len(req.prompt or "") // 3 + 1


#: tokens a chat format adds per message (role, separators) and per conversation (the reply's
#: start), as OpenAI counts them; generous for Anthropic's
_PER_MESSAGE, _PER_CHAT = 4, 3


def token_upper_bound(req: Request) -> int:
    """Prompt tokens an external model's provider can bill at most: every token of a byte-level
    BPE covers at least one byte, so the UTF-8 byte count bounds it from above. Providers bill
    what they render into the prompt beside the messages' text too — tool definitions and
    choice, response_format's schema, a tool turn's calls and ids — so their JSON's bytes
    count (a tool description once carried a budget's worth of text unreserved)."""
    if req.messages is not None:
        text = sum(len(m["content"].encode()) + _PER_MESSAGE for m in req.messages) + _PER_CHAT
        return text + _beside_text_bytes(req)
    return len(req.prompt) if isinstance(req.prompt, list) else len((req.prompt or "").encode()) + 1


_JSON = msgspec.json.Encoder()  # non-ASCII as UTF-8 bytes, never \u escapes: bytes stay a bound


def _beside_text_bytes(req: Request) -> int:
    n = 0
    if req.tools.defs:
        n += len(_JSON.encode(req.tools.defs)) + len(req.tools.named or req.tools.choice)
    if req.response_format is not None:
        n += len(_JSON.encode(req.response_format))
    for m in req.messages or ():
        rest = {k: v for k, v in m.items() if k not in ("role", "content")}
        if rest:  # an assistant turn's tool_calls, a tool turn's tool_call_id, a name
            n += len(_JSON.encode(rest))
    return n


def context_check(served: ServedModel, n_prompt: int, max_tokens: int | None) -> int:
    """The max_tokens to use; 400 when the prompt (+ max_tokens) does not fit the context."""
    limit = served.max_model_len
    if max_tokens is None:
        max_tokens = min(served.config.default_max_tokens, limit - n_prompt)
    if n_prompt + max(max_tokens, 1) > limit:
        raise APIError(
            400,
            over_context(limit, n_prompt, max_tokens),
            param="messages" if max_tokens <= 0 else "max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


async def measure(served: ServedModel, req: Request, guides: GuideChecker, domain: str) -> Measured:
    """`req` on `served`: its prompt ids and max_tokens; a forced tool choice's schema checked,
    its verdict cached in the team's cache `domain`."""
    plan = tool_plan(served, req)
    if plan is not None:  # a forced tool choice's schema: checked off the loop, as every guide
        await guides.check(plan.guide, "tools", domain)
    ids = await prompt_ids(served, req, plan)
    if served.tokenizer is not None:
        max_tokens = context_check(served, len(ids), req.max_tokens)
        keep = (  # the marked prefix is rendered and tokenized again: off the loop when big
            await asyncio.to_thread(retain_for, served, req, ids, plan)
            if req.retain is not None and len(ids) > _BIG_PROMPT // 4
            else retain_for(served, req, ids, plan)
        )
        return Measured(ids, len(ids), max_tokens, plan, retain=keep)
    # an external model: its provider counts; reserve on an upper bound of what it can bill
    limit = served.max_model_len  # required in the config for an external model: its context
    if req.max_tokens is not None and req.max_tokens >= limit:  # at least one prompt token besides
        raise APIError(
            400,
            f"max_tokens must be less than this model's context length ({limit} tokens), got "
            f"{req.max_tokens}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return Measured(
        ids,
        token_upper_bound(req),
        req.max_tokens or min(served.config.default_max_tokens, limit - 1),
    )
