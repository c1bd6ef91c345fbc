"""What aiohttp's HTTP parser refuses before any handler runs — an over-long header or request
line, a garbage request line — gets a 400 in OpenAI's error body from a real node process
(the node API is OpenAI-shaped too), which then completes the next request as usual
(runtime/http_errors.py)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from tests.nodes.conftest import COMMON
from tests.procs import duet_node, running
from tests.raw_http import assert_parser_errors_in_openai_shape

#: aiohttp's default max_line_size / max_field_size, which nodes keep
AIOHTTP_LIMIT = 8190


def test_parser_errors_in_openai_shape_then_serves(tiny_llama: Path, tmp_path: Path) -> None:
    node = duet_node("both", tiny_llama, tmp_path, *COMMON)
    with running(node):
        assert_parser_errors_in_openai_shape(node.port, AIOHTTP_LIMIT)
        req = urllib.request.Request(
            node.url + "/v1/completions",
            method="POST",
            data=json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            body = json.loads(r.read())
        assert r.status == 200 and body["usage"]["completion_tokens"] == 2, body
