"""The running half the translated APIs share: one request of `/v1/messages` (api/anthropic/)
or `/v1/responses` (api/responses/), once validated and admitted, run on the chat path and
answered in the API's own shape.

Each API authenticates, parses and translates its request itself (their keys, bodies and error
words differ; the first checks of a body are shared: gateway/serving/raw_body.py) into a
typed chat request (`TranslatedChat`, chat_body.py); then a `Translated` call checks it as any
chat request (gateway/serving/chat.py `check_chat`) and runs it through the one pipeline —
streamed through a `TranslatingSink` with the API's renderer when the client asked for a
stream — and answers: the stream's response (already written by the sink), or the whole chat
answer read (`chat_answer.read_completion`) and made into the API's JSON by its `whole`
function.
`opened` says whether the stream went out already: an error after that is the stream's own
`error` event (relay.py), never a second answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import msgspec
from aiohttp import web

from gateway.accounts.ledger import Caller
from gateway.api.chat_answer import ChatAnswer, Renderer, TranslatingSink, read_completion
from gateway.api.chat_body import TranslatedChat
from gateway.serving.chat import check_chat
from gateway.serving.generate import Generate
from gateway.serving.pipeline import run
from gateway.serving.relay import HttpEventStream
from gateway.state import GatewayState

_ENC = msgspec.json.Encoder()


def field_names(names: list[str]) -> str:
    """Names for an error message (one that is not an identifier quoted)."""
    return ", ".join(k if k.isidentifier() else repr(k) for k in names)


#: the whole chat answer and the model that made it → the API's answer body
Whole = Callable[[ChatAnswer, str], msgspec.Struct]


class Translated:
    """One translated request on the chat path (`renderer` None: the client wants no stream)."""

    def __init__(
        self, request: web.Request, renderer: Renderer | None, headers: dict[str, str] | None = None
    ) -> None:
        self.request = request
        #: headers the API adds to its answer, streamed or whole
        self.headers = headers or {}
        self.sink = (
            TranslatingSink(HttpEventStream(request), renderer, self.headers)
            if renderer is not None
            else None
        )

    @property
    def opened(self) -> bool:
        """The stream's headers went out: the answer has begun."""
        return self.sink is not None and self.sink.opened

    async def run(
        self, state: GatewayState, caller: Caller, chat: TranslatedChat, model: str, whole: Whole
    ) -> web.StreamResponse:
        """Run `chat` on the pipeline; `model` names the answer when no `x-duet-model-used`
        does."""
        answer = await run(
            state.serving,
            caller,
            Generate(
                replace(
                    check_chat(chat.body, chat.vllm), retain=chat.retain, thinking=chat.thinking
                )
            ),
            tier_header=self.request.headers.get("x-duet-tier"),
            sink=self.sink,
        )
        if answer.body is None:
            sink = self.sink
            assert (
                sink is not None
                and isinstance(sink.inner, HttpEventStream)
                and sink.inner.response is not None
            )
            return sink.inner.response
        out = whole(read_completion(answer.body), answer.headers.get("x-duet-model-used", model))
        return web.Response(
            status=answer.status,
            body=_ENC.encode(out),
            content_type="application/json",
            headers={**answer.headers, **self.headers},
        )
