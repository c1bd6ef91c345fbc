"""Shared fixtures: a seeded tiny random Llama (fast tests) and the pulled SmolLM2 (session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiny_llama import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GQA (4 query heads, 2 KV heads), 2 layers, hidden 64."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The default model's directory; pulled (and converted) once if missing."""
    from engine.pull import pull
    from protocol.models import DEFAULT_MODEL

    return pull(DEFAULT_MODEL, progress=lambda _: None)
