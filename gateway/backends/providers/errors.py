"""`ProviderError`: the one exception a provider raises, whatever went wrong upstream.

`status` is the HTTP status to reason about (the provider's own status for HTTP errors, 502
for a connection that failed or dropped, 504 for a timeout, 503 for an open breaker);
`retryable` says whether the same request may succeed if sent again (429, 5xx, connect errors,
timeouts — and only before the first chunk reached the caller); `retry_after` is the delay the
provider asked for, in seconds; `kind` says which failure it was, for logs, metrics and the
fallback decision. The message never contains the API key.
"""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal[
    "http",  # the provider answered with an error status
    "connect",  # no connection, or it dropped before the first chunk
    "timeout",  # connect / first byte / idle timeout
    "breaker_open",  # not sent: the provider's circuit breaker is open
    "stream_interrupted",  # failed after chunks were already yielded; never retried
    "invalid_response",  # the provider answered 200 with something we cannot read
    "invalid_request",  # the request cannot be expressed in this provider's API
]

RETRYABLE_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})


class ProviderError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        retryable: bool = False,
        retry_after: float | None = None,
        kind: ErrorKind = "http",
        provider: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retryable = retryable
        self.retry_after = retry_after
        self.kind: ErrorKind = kind
        self.provider = provider
        #: the provider's own error type ("rate_limit_error", "overloaded_error", ...)
        self.error_type = error_type

    def __repr__(self) -> str:
        return (
            f"ProviderError(status={self.status}, kind={self.kind!r}, retryable={self.retryable}, "
            f"retry_after={self.retry_after}, provider={self.provider!r}, message={self.message!r})"
        )

    def openai_body(self) -> dict[str, dict[str, str | None]]:
        """OpenAI's error body, for the gateway to hand to its client."""
        type_ = "invalid_request_error" if self.status < 500 and self.status != 429 else "api_error"
        if self.status == 429:
            type_ = "rate_limit_error"
        return {"error": {"message": self.message, "type": type_, "param": None, "code": self.kind}}


def http_error(
    status: int, message: str, *, retry_after: float | None = None, error_type: str | None = None
) -> ProviderError:
    return ProviderError(
        status,
        message,
        retryable=status in RETRYABLE_STATUSES or status >= 500,
        retry_after=retry_after,
        kind="http",
        error_type=error_type,
    )
