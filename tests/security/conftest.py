"""Fixtures shared by tests/security: `fake`, one fake OpenAI-compatible provider ("gpt") that
the gateway's external model talks to (tests/gateway/test_providers_e2e.py's FakeServers), so a
test can hold, fail or slow a stream on purpose; stopped at the end of the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.test_providers_e2e import FakeServers


@pytest.fixture
def fake() -> Iterator[FakeServers]:
    servers = FakeServers({"gpt": "openai"})
    try:
        yield servers
    finally:
        servers.close()
