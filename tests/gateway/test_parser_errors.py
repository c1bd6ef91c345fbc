"""What aiohttp's HTTP parser refuses before any handler runs — an over-long header or request
line, a garbage request line — gets a 400 in OpenAI's error body from a real gateway process,
which then serves the next request as usual (runtime/http_errors.py)."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.helpers import MODEL, gateway_proc, http, tiny_model
from tests.procs import free_port, running
from tests.raw_http import assert_parser_errors_in_openai_shape

MAX_HEADER = 8192


def test_parser_errors_in_openai_shape_then_serves(tiny_llama: Path, tmp_path: Path) -> None:
    # No node is needed: nothing here reaches one (the static node's port is closed).
    g = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama, both=[f"http://127.0.0.1:{free_port()}"])},
        server={"max_header_bytes": MAX_HEADER},
    )
    with running(g):
        assert_parser_errors_in_openai_shape(g.port, MAX_HEADER)
        status, _, body = http(g.url + "/v1/models")
        assert status == 200 and MODEL in [m["id"] for m in body["data"]], body
