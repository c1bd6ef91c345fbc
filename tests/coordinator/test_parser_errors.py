"""What aiohttp's HTTP parser refuses before any handler runs — an over-long header or request
line, a garbage request line — gets a 400 in the same OpenAI-shaped error body as the
coordinator's own errors, from a real coordinator process, which then answers the next
request as usual (runtime/http_errors.py)."""

from __future__ import annotations

from pathlib import Path

from coordinator.etcd_server import EtcdServer
from tests.coordinator.conftest import coordinator, get
from tests.procs import running
from tests.raw_http import assert_parser_errors_in_openai_shape

#: aiohttp's default max_line_size / max_field_size, which the coordinator keeps
AIOHTTP_LIMIT = 8190


def test_parser_errors_in_openai_shape_then_serves(etcd: EtcdServer, tmp_path: Path) -> None:
    c = coordinator(tmp_path, etcd.url)
    with running(c):
        assert_parser_errors_in_openai_shape(c.port, AIOHTTP_LIMIT)
        assert get(c.url + "/cluster")["nodes"] == []
