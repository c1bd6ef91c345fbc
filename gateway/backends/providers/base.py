"""The seam between the gateway and commercial model APIs: `Provider`.

How the gateway wires it:

    from gateway.backends.providers import build_provider, ProviderConfig, ProviderError
    provider = build_provider(ProviderConfig.from_dict(table), session)   # one per [[providers]]
    result = await provider.chat(body)            # body: the client's chat request (a dict)
    result.response                               # an OpenAI `chat.completion` dict, with usage
    result.usage, result.cost_usd                 # TokenUsage, USD at this provider's prices
    async for chunk in provider.chat_stream(body):  # OpenAI `chat.completion.chunk` dicts;
        ...                                       # the last one has `usage` (and no choices)
    provider.cost(usage)                          # USD for a stream's final usage

- `session` is the process's one aiohttp.ClientSession; a provider never opens its own.
- `body` has been validated by the gateway as an OpenAI chat request; its `model` is ignored
  (the provider sends `config.upstream_model`); fields the provider's API does not know (duet
  extensions) are not forwarded. The `model` inside responses and chunks is the provider's;
  the gateway reports the model used in `x-duet-model-used`.
- Every failure is a `ProviderError` (see errors.py). Retries (resilience.py) happen inside
  `chat`, and inside `chat_stream` only until the first chunk has been yielded: after that a
  failure raises `ProviderError(kind="stream_interrupted")` and the caller ends its own stream
  with an error event; nothing already yielded is ever sent again.
- `provider.breaker` (breaker.py) refuses calls while open (`kind="breaker_open"`, status 503,
  `retry_after` = the rest of the cool-down); metrics.py exports its state as a gauge.
- Timeouts: connect, first byte, idle stream (config.TimeoutConfig).
- `clock`, `sleep` and `rng` are injectable so tests drive the breaker and the backoff
  without waiting.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, Protocol

import aiohttp
import msgspec

from gateway.backends.providers.breaker import CircuitBreaker
from gateway.backends.providers.config import ProviderConfig
from gateway.backends.providers.cost import TokenUsage, cost_usd
from gateway.backends.providers.errors import ProviderError
from gateway.backends.providers.resilience import RetryPolicy
from gateway.backends.providers.sse import sse_events

#: the most we read of a non-streaming answer or an error body
MAX_BODY = 32 << 20
MAX_ERROR_BODY = 64 << 10


class ChatResult(msgspec.Struct, frozen=True, kw_only=True):
    #: an OpenAI chat.completion dict (its `usage` filled in)
    response: dict[str, Any]
    usage: TokenUsage
    cost_usd: float
    #: the configured name of the model that answered (not the provider's internal name)
    model: str
    #: attempts made, the successful one included
    attempts: int


class StreamTranslator(Protocol):
    """Turns one provider's SSE events into OpenAI chunks (one translator per attempt)."""

    done: bool

    def feed(self, event: str | None, data: str) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]:
        """Chunks still owed at the end (the usage chunk); raises ProviderError when the
        stream ended before the provider said it was complete."""
        ...

    @property
    def usage(self) -> TokenUsage | None: ...


class Provider(abc.ABC):
    kind: ClassVar[str]

    def __init__(
        self,
        config: ProviderConfig,
        session: aiohttp.ClientSession,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.session = session
        self.breaker = CircuitBreaker(config.breaker, clock)
        self.retry = RetryPolicy(config.retry, rng)
        self._sleep = sleep

    @property
    def name(self) -> str:
        return self.config.name

    def cost(self, usage: TokenUsage) -> float:
        c = self.config
        return cost_usd(
            usage,
            c.input_price_per_m,
            c.output_price_per_m,
            c.cached_price_per_m,
            c.cache_write_price_per_m,
        )

    # -- what each wire format supplies ----------------------------------------------------

    @abc.abstractmethod
    def _url(self) -> str: ...

    @abc.abstractmethod
    def _auth_headers(self, key: str) -> dict[str, str]: ...

    def _extra_headers(self) -> dict[str, str]:
        return {}

    @abc.abstractmethod
    def _payload(self, body: dict[str, Any], stream: bool) -> dict[str, Any]:
        """The provider's request body; ProviderError(400, kind="invalid_request") if the
        chat request cannot be expressed in its API."""

    @abc.abstractmethod
    def _completion(self, data: Any, body: dict[str, Any]) -> tuple[dict[str, Any], TokenUsage]:
        """A 200 answer → (chat.completion dict, usage); ProviderError if unreadable."""

    @abc.abstractmethod
    def _error(self, status: int, headers: Any, data: bytes) -> ProviderError: ...

    @abc.abstractmethod
    def _translator(self, body: dict[str, Any]) -> StreamTranslator: ...

    # -- calls -----------------------------------------------------------------------------

    async def chat(self, body: dict[str, Any]) -> ChatResult:
        payload = self._payload(body, stream=False)
        attempt = 0
        last: ProviderError | None = None
        while True:
            attempt += 1
            self._admit(last)
            try:
                response, usage = await self._unary(payload, body)
            except BaseException as e:
                err = self._classify(e)
                if (
                    err is None
                ):  # cancelled (client gone) or a bug here: says nothing of the provider
                    self.breaker.record_neutral()
                    raise
                self._settle(err)
                delay = self.retry.delay(attempt, err)
                if delay is None:
                    raise err from (None if err is e else e)
                last = err
                await self._sleep(delay)
                continue
            self.breaker.record_success()
            response["usage"] = usage.openai()
            return ChatResult(
                response=response,
                usage=usage,
                cost_usd=self.cost(usage),
                model=self.name,
                attempts=attempt,
            )

    async def _unary(
        self, payload: dict[str, Any], body: dict[str, Any]
    ) -> tuple[dict[str, Any], TokenUsage]:
        deadline = asyncio.get_running_loop().time() + self.config.timeouts.first_byte_s
        async with await self._send(payload, deadline) as resp:
            async with asyncio.timeout(self.config.timeouts.idle_s):
                raw = await _read(resp, MAX_BODY)
        try:
            data = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise ProviderError(
                502, "the provider's answer is not JSON", retryable=True, kind="invalid_response"
            ) from None
        return self._completion(data, body)

    async def chat_stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        payload = self._payload(body, stream=True)
        attempt = 0
        last: ProviderError | None = None
        while True:
            attempt += 1
            self._admit(last)
            resp: aiohttp.ClientResponse | None = None
            events: AsyncIterator[tuple[str | None, str]] | None = None
            try:
                deadline = asyncio.get_running_loop().time() + self.config.timeouts.first_byte_s
                resp = await self._send(payload, deadline)
                events = sse_events(resp.content, deadline, self.config.timeouts.idle_s)
                translator = self._translator(body)
                pending: list[dict[str, Any]] = []
                while not pending:
                    try:
                        ev, data = await anext(events)
                    except StopAsyncIteration:
                        raise ProviderError(
                            502,
                            "the provider closed the stream before its first chunk",
                            retryable=True,
                            kind="connect",
                        ) from None
                    pending = translator.feed(ev, data)
                    if translator.done and not pending:
                        pending = translator.finish()
                        if not pending:
                            raise ProviderError(
                                502,
                                "the provider's stream ended with no chunk",
                                retryable=True,
                                kind="invalid_response",
                            )
            except BaseException as e:
                if resp is not None:
                    resp.close()
                err = self._classify(e)
                if err is None:
                    self.breaker.record_neutral()
                    raise
                await _close(events, None)
                self._settle(err)
                delay = self.retry.delay(attempt, err)
                if delay is None:
                    raise err from (None if err is e else e)
                last = err
                await self._sleep(delay)
                continue
            break
        # Committed: from here on nothing is retried, so no chunk is ever sent twice.
        settled = False
        try:
            for chunk in pending:
                yield chunk
            if not translator.done:
                async for ev, data in events:
                    for chunk in translator.feed(ev, data):
                        yield chunk
                    if translator.done:
                        break
            for chunk in translator.finish():
                yield chunk
            self.breaker.record_success()
            settled = True
        except (ProviderError, aiohttp.ClientError, TimeoutError, OSError) as e:
            cause = e if isinstance(e, ProviderError) else _transport_error(e)
            self.breaker.record_failure()
            settled = True
            raise ProviderError(
                cause.status,
                f"stream interrupted: {cause.message}",
                retryable=False,
                kind="stream_interrupted",
                provider=self.name,
                error_type=cause.error_type,
            ) from e
        finally:
            if not settled:
                self.breaker.record_neutral()  # the caller stopped reading
            await _close(events, resp)

    # -- helpers ---------------------------------------------------------------------------

    def _admit(self, last: ProviderError | None) -> None:
        if not self.breaker.allow():
            if last is not None:
                raise last  # a retry the breaker now refuses: the real error says more
            raise ProviderError(
                503,
                f"provider {self.name!r} is unavailable (circuit breaker open)",
                kind="breaker_open",
                retry_after=self.breaker.retry_after(),
                provider=self.name,
            )

    async def _send(self, payload: dict[str, Any], deadline: float) -> Any:
        headers = {
            "content-type": "application/json",
            **self._extra_headers(),
            **self.config.headers,
        }
        if self.config.api_key_env:
            key = self.config.api_key()
            if not key:
                raise ProviderError(
                    503,
                    f"provider {self.name!r}: environment variable "
                    f"{self.config.api_key_env} is not set",
                    kind="invalid_request",
                )
            headers.update(self._auth_headers(key))
        t = self.config.timeouts
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(max(0.0, deadline - loop.time())):
            resp = await self.session.post(
                self._url(),
                data=msgspec.json.encode(payload),
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
            )
        if resp.status != 200:
            try:
                async with asyncio.timeout(t.idle_s):
                    raw = await _read(resp, MAX_ERROR_BODY, truncate=True)
            except (aiohttp.ClientError, TimeoutError):
                raw = b""
            finally:
                resp.release()
            raise self._error(resp.status, resp.headers, raw)
        return resp

    def _classify(self, e: BaseException) -> ProviderError | None:
        if isinstance(e, ProviderError):
            e.provider = self.name
            return e
        if isinstance(e, aiohttp.ClientError | TimeoutError | OSError):
            err = _transport_error(e)
            err.provider = self.name
            return err
        return None

    def _settle(self, e: ProviderError) -> None:
        """Tell the breaker what a failed attempt says about the provider."""
        if e.kind == "breaker_open":
            return
        if e.kind in ("connect", "timeout", "invalid_response") or (
            e.kind == "http" and e.status in self.config.breaker.failure_statuses
        ):
            self.breaker.record_failure()
        else:
            self.breaker.record_neutral()


def _transport_error(e: BaseException) -> ProviderError:
    if isinstance(e, TimeoutError):  # aiohttp's timeouts subclass it too
        return ProviderError(
            504, "timed out waiting for the provider", retryable=True, kind="timeout"
        )
    return ProviderError(
        502,
        f"connection to the provider failed: {type(e).__name__}: {e}",
        retryable=True,
        kind="connect",
    )


async def _read(resp: aiohttp.ClientResponse, limit: int, truncate: bool = False) -> bytes:
    buf = bytearray()
    async for piece in resp.content.iter_any():
        buf += piece
        if len(buf) > limit:
            if truncate:
                return bytes(buf[:limit])
            raise ProviderError(
                502,
                f"the provider's answer is larger than {limit} bytes",
                retryable=False,
                kind="invalid_response",
            )
    return bytes(buf)


async def _close(events: Any, resp: aiohttp.ClientResponse | None) -> None:
    if events is not None:
        with contextlib.suppress(Exception):
            await events.aclose()
    if resp is not None:
        resp.close()
