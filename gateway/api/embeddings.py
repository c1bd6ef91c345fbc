"""`POST /v1/embeddings`: OpenAI's embeddings API on models of `kind = "embedding"`.

auth → parse and check (`parse_embedding`: input a string, strings, token ids or token-id
arrays; 1..2,048 items; encoding_format float | base64; dimensions 1..the model's size; user) →
the model (404 unknown, 403 forbidden for the team, 400 when it is a generation model) →
tokenize each item with the model's tokenizer (400 for an item over the context) → reserve
quota for the prompt tokens (`Ledger`, the completions' path: same store, limits, usage
record, prices at `input_usd_per_mtok`) → a tier admission slot → `EmbeddingBackend.embed`:
route through the coordinator with `task: embed` (only `--task embed` nodes answer; etcd's
view or the model's `static` list when no coordinator answers) and `POST /v1/embeddings` on
that node, retried on another node when one fails (up to `[routing] max_attempts`) → settle →
OpenAI's response (`float` lists, or `base64` of the little-endian float32 bytes). Traced as
chat is: auth, tokenize and quota spans, and OTel's embeddings span `embeddings {model}` around
the call to the nodes (gateway/serving/spans.py).

Invariants: the ledger settles exactly once (as serve.py's); usage counts the tokens the
gateway measured, which are exactly the ids the node embedded; a node URL comes only from the
router. The reverse refusal — chat or completions on an embedding model — is serve.py's.
"""

from __future__ import annotations

import array
import asyncio
import base64
import logging
import sys
import time
from collections.abc import Callable

import msgspec
from aiohttp import web

from gateway.accounts.ledger import Caller, Ledger, Order, UsageStatus
from gateway.backends.base import Accounting, ServedModel
from gateway.backends.embedding import EmbeddingBackend
from gateway.config import Tier
from gateway.serving.requests import MAX_USER, Endpoint
from gateway.serving.spans import client_span
from gateway.serving.tiers import Shed, team_tier
from gateway.state import GatewayState
from protocol.embeddings import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    EncodingFormat,
    NodeEmbeddingResponse,
)
from protocol.limits import max_context
from protocol.openai import APIError
from runtime.tracing import (
    GEN_AI_DIMENSIONS,
    GEN_AI_ENCODING_FORMATS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_PROVIDER,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_RESPONSE_MODEL,
)

log = logging.getLogger("duet.gateway.embeddings")
_DEC = msgspec.json.Decoder(EmbeddingRequest)
_ENC = msgspec.json.Encoder()
#: characters of text inputs above which tokenizing moves off the event loop
_BIG_INPUT = 16_384
#: OTel GenAI's operation name (and so the span's: `embeddings {model}`)
EMBEDDINGS = "embeddings"


def parse_embedding(raw: bytes) -> tuple[EmbeddingRequest, list[str] | list[list[int]]]:
    """The checked request and its items: strings, or token-id lists (never mixed)."""
    try:
        body = _DEC.decode(raw)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = (
            msg.rsplit("`$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
            if "`$." in msg
            else None
        )
        raise APIError(400, f"invalid request: {msg}", param=param) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    inp = body.input
    items: list[str] | list[list[int]]
    if isinstance(inp, str):
        items = [inp]
    elif inp and all(isinstance(x, int) and not isinstance(x, bool) for x in inp):
        items = [list(inp)]  # type: ignore[arg-type]
    elif all(isinstance(x, str) for x in inp) or all(isinstance(x, list) for x in inp):
        items = list(inp)  # type: ignore[arg-type]
    else:
        raise APIError(
            400,
            "input must be a string, an array of strings, an array of token ids or an array of "
            "token-id arrays (not a mix)",
            param="input",
        )
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise APIError(
            400,
            f"input holds {len(items)} items; at most {MAX_EMBEDDING_INPUTS} per request",
            param="input",
        )
    for i, item in enumerate(items):
        if not item:
            raise APIError(400, f"input[{i}] is empty", param="input")
    if body.dimensions is not None and body.dimensions < 1:
        raise APIError(
            400, f"dimensions must be at least 1, got {body.dimensions}", param="dimensions"
        )
    if body.user is not None and len(body.user) > MAX_USER:
        raise APIError(
            400,
            f"user must be a string of at most {MAX_USER} characters, got {len(body.user)}",
            param="user",
        )
    return body, items


def _token_ids(served: ServedModel, items: list[str] | list[list[int]]) -> list[list[int]]:
    tok = served.tokenizer
    assert tok is not None
    if isinstance(items[0], str):
        return [tok.encode(t) for t in items]  # type: ignore[arg-type]
    for i, ids in enumerate(items):
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]  # type: ignore[union-attr]
        if bad:
            raise APIError(
                400,
                f"input[{i}]: token ids out of the vocabulary (size {tok.vocab_size}): {bad[:5]}",
                param="input",
            )
    return items  # type: ignore[return-value]


async def measure_items(served: ServedModel, items: list[str] | list[list[int]]) -> list[list[int]]:
    """Each item's token ids on the model; 400 for an item longer than its context."""
    big = isinstance(items[0], str) and sum(map(len, items)) > _BIG_INPUT  # type: ignore[arg-type]
    ids = await asyncio.to_thread(_token_ids, served, items) if big else _token_ids(served, items)
    limit = served.max_model_len
    for i, x in enumerate(ids):
        if len(x) > limit:
            raise APIError(
                400,
                f"input[{i}] is {len(x)} tokens; {max_context(limit)}",
                param="input",
                code="context_length_exceeded",
            )
        if not x:
            raise APIError(400, f"input[{i}] has no tokens", param="input")
    return ids


def _floats(le: bytes) -> list[float]:
    a = array.array("f", le)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def render(
    out: NodeEmbeddingResponse, fmt: EncodingFormat, model: str, n_tokens: int
) -> EmbeddingResponse:
    enc: Callable[[bytes], list[float] | str] = (
        _floats if fmt == EncodingFormat.FLOAT else (lambda b: base64.b64encode(b).decode("ascii"))
    )
    return EmbeddingResponse(
        data=[EmbeddingData(index=i, embedding=enc(v)) for i, v in enumerate(out.vectors)],
        model=model,
        usage=EmbeddingUsage(prompt_tokens=n_tokens, total_tokens=n_tokens),
    )


def _model(state: GatewayState, caller: Caller, name: str) -> ServedModel:
    served = state.models.get(name)
    if served is None:
        names = sorted(n for n, m in state.models.items() if m.config.kind == "embedding")
        raise APIError(
            404,
            f"the model {name!r} does not exist (embedding models: {', '.join(names) or 'none'})",
            param="model",
            code="model_not_found",
        )
    if name in state.config.team_policy(caller.team.id).forbid:
        raise APIError(
            403,
            f"team {caller.team.id!r} may not use model {name!r}",
            type_="permission_error",
            param="model",
            code="model_forbidden",
        )
    if served.config.kind != "embedding" or not isinstance(served.backend, EmbeddingBackend):
        raise APIError(
            400,
            f"{name!r} is a text generation model; /v1/embeddings needs a model of kind "
            '"embedding"',
            param="model",
            code="wrong_model_kind",
        )
    return served


async def run(
    state: GatewayState, caller: Caller, raw: bytes, *, tier_header: str | None = None
) -> tuple[EmbeddingResponse, dict[str, str]]:
    """One embeddings request of an authenticated caller: the response and its headers."""
    body, items = parse_embedding(raw)
    served = _model(state, caller, body.model)
    backend = served.backend
    assert isinstance(backend, EmbeddingBackend)
    size = backend.embedding_size
    if size is not None and body.dimensions is not None and body.dimensions > size:
        raise APIError(
            400,
            f"dimensions must be at most {size} for {body.model!r}, got {body.dimensions}",
            param="dimensions",
        )
    tier = team_tier(tier_header, None, caller.team, state.config.team_policy(caller.team.id))
    state.admission.check_team(
        caller.team, state.config.quotas.default_max_concurrent
    )  # before tokenizing
    with state.admission.teams.running(caller.team.id):
        return await _measured(state, caller, body, served, items, tier)


async def _measured(
    state: GatewayState,
    caller: Caller,
    body: EmbeddingRequest,
    served: ServedModel,
    items: list[str] | list[list[int]],
    tier: Tier,
) -> tuple[EmbeddingResponse, dict[str, str]]:
    """The rest of `run`, counted in the team gate's in-flight requests."""
    backend = served.backend
    assert isinstance(backend, EmbeddingBackend)
    tr, name = state.tracing, served.config.name
    tr.annotate(
        {
            GEN_AI_OPERATION: EMBEDDINGS,
            GEN_AI_PROVIDER: "duet",
            GEN_AI_REQUEST_MODEL: body.model,
            "duet.request_id": caller.request_id,
            "duet.team": caller.team.id,
            "duet.tier": tier,
        }
    )
    with tr.span("gateway.tokenize", {GEN_AI_REQUEST_MODEL: name}) as span:
        ids = await measure_items(served, items)
        n_tokens = sum(map(len, ids))
        if span is not None:
            span.set_attribute(GEN_AI_INPUT_TOKENS, n_tokens)
    order = Order(
        endpoint=Endpoint.EMBEDDING.value,
        model_requested=body.model,
        user=body.user or None,
        tier=tier,
        model=served.config,
        chain=(served.config,),
        prompt_tokens=n_tokens,
        counted_prompt_tokens=n_tokens,
        completion_tokens=0,
    )
    with tr.span("gateway.quota.reserve", {"duet.team": caller.team.id}):
        ledger = await Ledger.reserve(state.books, caller, order)
    state.admission.teams.started(caller.team)
    ledger.attempt(served.config, n_tokens)
    acc = Accounting(prompt_tokens=n_tokens, model_used=name)
    # OTel's embeddings span: the dimensions asked for (else the model's, when known) and the format
    dims = body.dimensions or backend.embedding_size
    asked = {
        GEN_AI_ENCODING_FORMATS: [body.encoding_format.value],
        **({GEN_AI_DIMENSIONS: dims} if dims else {}),
    }

    def usage() -> (
        dict[str, str | int | list[str]] | None
    ):  # what a node embedded (none reached: nothing)
        return (
            {
                GEN_AI_RESPONSE_MODEL: name,
                GEN_AI_INPUT_TOKENS: n_tokens,
                "duet.nodes": list(acc.nodes),
            }
            if acc.served
            else None
        )

    try:
        with client_span(tr, EMBEDDINGS, name, served.config.provider or "duet", asked, usage):
            async with state.admission.slot(tier):
                out = await backend.embed(
                    caller.request_id, served, ids, body.dimensions, tier, acc
                )
            acc.first_token_at = time.monotonic()
        await ledger.commit(UsageStatus.OK, acc)
    except APIError as e:
        ledger.submit(UsageStatus.SHED if isinstance(e, Shed) else UsageStatus.ERROR, acc)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        ledger.submit(UsageStatus.CLIENT_DISCONNECTED, acc)
        raise
    finally:
        ledger.submit(UsageStatus.ERROR, acc)  # a no-op once settled
        if tr.enabled:
            r = ledger.record
            tr.annotate(
                {
                    GEN_AI_RESPONSE_MODEL: r.model_used,
                    GEN_AI_INPUT_TOKENS: r.prompt_tokens,
                    "duet.status": r.status,
                    "duet.cost_usd": r.cost_usd,
                    "duet.nodes": list(r.nodes),
                }
            )
    headers = {
        **ledger.headers,
        "X-Request-Id": caller.request_id,
        "x-duet-tier": tier,
        "x-duet-model-used": served.config.name,
        "x-duet-cost-usd": f"{ledger.record.cost_usd:.8f}",
    }
    return render(out, body.encoding_format, served.config.name, n_tokens), headers


async def handle(state: GatewayState, request: web.Request, request_id: str) -> web.Response:
    """The HTTP handler: authenticate, run, answer in OpenAI's shape."""
    t0 = time.monotonic()
    with state.tracing.span("gateway.auth"):
        key, team = await state.auth.authenticate(request)
    raw = await request.read()
    body, headers = await run(
        state,
        Caller(key, team, request_id, t0),
        raw,
        tier_header=request.headers.get("x-duet-tier"),
    )
    return web.Response(body=_ENC.encode(body), content_type="application/json", headers=headers)
