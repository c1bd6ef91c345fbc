"""Raw HTTP over a socket, for what no HTTP client sends — an over-long header or request line,
a garbage request line, a request trickled in — and the checks that a duet server refuses each
in OpenAI's error body and closes the connection (runtime/http_errors.py: a 400;
runtime/read_deadlines.py: a 408). Shared by the gateway, node and coordinator tests."""

from __future__ import annotations

import contextlib
import json
import socket
from typing import Any

from tests.wait import wait_for

#: far over any duet server's header limit (the gateway's is configurable, the others' 8190)
_LONG = 20_000
#: (name, bytes sent, OpenAI error code, words in the message; "{limit}" is the server's limit)
PARSER_CASES = [
    (
        "over-long header",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * _LONG + b"\r\n\r\n",
        "header_too_large",
        "longer than this server accepts ({limit} bytes)",
    ),
    (
        "over-long request line",
        b"GET /" + b"a" * _LONG + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "header_too_large",
        "longer than this server accepts ({limit} bytes)",
    ),
    (
        "garbage request line",
        b"\x00\x01 this is not HTTP\r\n\r\n",
        "bad_request",
        "malformed request line",
    ),
]


def exchange(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """Send `data`, read until the server closes the connection: (status, headers, body).
    Headers are keyed in lower case. A server that keeps the connection open fails (timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete HTTP response: {raw[:300]!r}"
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return int(status_line.split()[1]), headers, body


def assert_openai_error(
    status: int, headers: dict[str, str], body: bytes, want_status: int, code: str, words: str
) -> dict[str, Any]:
    """The response is OpenAI's error body with `want_status`, `code` and `words` in the message."""
    assert status == want_status, (status, headers, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), (headers, body[:300])
    parsed = json.loads(body)
    err = parsed["error"]
    assert set(parsed) == {"error"} and set(err) == {"message", "type", "param", "code"}, parsed
    assert err["type"] == "invalid_request_error" and err["code"] == code, parsed
    assert words in err["message"], parsed
    return err


def assert_parser_errors_in_openai_shape(port: int, limit: int) -> None:
    """Every PARSER_CASES request gets a 400 in OpenAI's error body, with Connection: close."""
    for name, data, code, words in PARSER_CASES:
        status, headers, body = exchange(port, data)
        try:
            assert headers.get("connection", "").lower() == "close", headers
            assert_openai_error(status, headers, body, 400, code, words.format(limit=limit))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


class RawConn:
    """A raw socket to a server on 127.0.0.1 that keeps what the server answers."""

    def __init__(self, port: int) -> None:
        self.s = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.got = bytearray()

    def closed(self) -> bool:
        """True once the server closed the connection (a read sees EOF or a reset), False
        while it is open."""
        self.s.settimeout(0.05)
        try:
            chunk = self.s.recv(65536)
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        self.got += chunk
        return chunk == b""

    def send(self, data: bytes) -> None:
        """Send, unless the server has closed the connection already."""
        with contextlib.suppress(OSError):  # broken pipe or reset: what closed() reports next
            self.s.sendall(data)

    def _recv(self, timeout: float) -> bytes:
        self.s.settimeout(timeout)
        try:
            chunk = self.s.recv(65536)
        except TimeoutError:
            raise AssertionError(
                f"no answer within {timeout:g} s (got {bytes(self.got)[:300]!r})"
            ) from None
        assert chunk, f"the connection closed mid-response: {bytes(self.got)[:300]!r}"
        return chunk

    def response(self, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
        """One whole response (Content-Length framed) off the connection; the server has
        `timeout` seconds for each read."""
        while b"\r\n\r\n" not in self.got:
            self.got += self._recv(timeout)
        head, _, rest = bytes(self.got).partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
        n = int(headers.get("content-length", "0"))
        while len(rest) < n:
            rest += self._recv(timeout)
        self.got = bytearray(rest[n:])
        return int(status_line.split()[1]), headers, rest[:n]

    def close(self) -> None:
        self.s.close()


def assert_timed_out(c: RawConn, words: str, timeout: float = 30.0) -> None:
    """The server answers the connection's request 408 in OpenAI's error body (`words` in its
    message) within `timeout` seconds, then closes the connection."""
    status, headers, body = c.response(timeout)
    assert headers.get("connection", "").lower() == "close", headers
    assert_openai_error(status, headers, body, 408, "request_timeout", words)
    wait_for(c.closed, timeout, "the connection to be closed after its 408")
