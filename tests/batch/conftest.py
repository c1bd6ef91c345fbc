"""Batch-tier fixtures: a colocated tiny-model node shared by a module, the batch app served
in-process, official openai clients for two teams, and request-file builders."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL for store tests)
from tests.procs import Proc, duet_node, running

NODE_ARGS = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")
WORDS = ["fox", "dog", "Paris", "Berlin", "capital", "quick", "lazy", "brown", "main", "text"]


@pytest.fixture(scope="module")
def node(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    n = duet_node("both", tiny_llama, tmp_path_factory.mktemp("node"), *NODE_ARGS)
    with running(n):
        yield n


@pytest.fixture(scope="module")
def model_name(node: Proc) -> str:
    with urllib.request.urlopen(node.url + "/health", timeout=5) as r:
        return json.loads(r.read())["model"]


def chat_lines(n: int, model: str, max_tokens: int = 8, **extra: Any) -> list[dict[str, Any]]:
    """n distinct greedy chat requests as batch input lines."""
    out = []
    for i in range(n):
        content = f"{WORDS[i % len(WORDS)]} {WORDS[(i * 7 + 3) % len(WORDS)]} {i}"
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "user": f"req-{i}",
            **extra,
        }
        out.append(
            {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return out


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def client(url: str, key: str = "key-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture
async def serve(aiohttp_server: Any) -> Callable[..., Awaitable[str]]:
    """serve(app) → base URL of the app on a loopback port; stopped at the end of the test."""

    async def start(app: Any) -> str:
        server = await aiohttp_server(app, host="127.0.0.1")
        return str(server.make_url("")).rstrip("/")

    return start


@pytest.fixture
async def gate() -> AsyncIterator[dict[str, bool]]:
    """A `may_run` switch the test flips to pause and resume batch work."""
    yield {"open": True}
