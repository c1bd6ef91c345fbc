"""A NIXL agent's UCX backend that fails to start once is started again, not given up on: a
fresh-clone CI run lost a decode node at start-up to one "UCX endpoint create failed" in NIXL's
intra-agent setup, which under CI=true (no tcp fallback) ended the node. Only when every attempt
fails is NIXL unavailable, and the error says what each attempt got.

The agents are NIXL's own; the start-up failure is injected into the first `create_backend`
(a transient UCX failure cannot be produced on demand)."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

import kvtransfer.nixl_transport as nt
from kvtransfer import BackendUnavailable, unavailable_reason
from runtime.strict import strict_mode
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool


@pytest.fixture
def api() -> ModuleType:
    reason = unavailable_reason("nixl")
    if reason is not None:
        (pytest.fail if strict_mode() else pytest.skip)(f"nixl not usable here: {reason}")
    return nt.import_nixl()


def _failing_first(api: ModuleType, failures: int) -> tuple[SimpleNamespace, list[str]]:
    """NIXL's API whose first `failures` agents fail in create_backend as UCX did."""
    made: list[str] = []

    def nixl_agent(name: str, config: Any) -> Any:
        agent = api.nixl_agent(name, config)
        made.append(name)
        if len(made) <= failures:

            def create_backend(*_: Any) -> None:
                raise RuntimeError("NIXL_ERR_BACKEND: UCX endpoint create failed (injected)")

            agent.create_backend = create_backend
        return agent

    return SimpleNamespace(nixl_agent=nixl_agent, nixl_agent_config=api.nixl_agent_config), made


async def test_a_backend_that_fails_once_is_started_again(
    api: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    flaky, made = _failing_first(api, 1)
    monkeypatch.setattr(nt, "import_nixl", lambda: flaky)
    monkeypatch.setattr(nt, "AGENT_RETRY_DELAY_S", 0.01)
    t = nt.NixlTransport(engine_id="start-retry")
    try:
        assert made == ["start-retry", "start-retry"]
        # the second agent is a working one: the pool registers and its metadata is served
        await t.register_pool(torch.from_numpy(HostPool(TEST_LAYOUT, 1).bytes), TEST_LAYOUT)
        assert t._agent_md
    finally:
        await t.close()


def test_a_backend_that_never_starts_is_unavailable_with_every_attempts_error(
    api: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    flaky, made = _failing_first(api, 99)
    monkeypatch.setattr(nt, "import_nixl", lambda: flaky)
    monkeypatch.setattr(nt, "AGENT_RETRY_DELAY_S", 0.01)
    with pytest.raises(BackendUnavailable, match="after 3 attempts") as e:
        nt.NixlTransport(engine_id="start-never")
    assert len(made) == nt.AGENT_START_ATTEMPTS == 3
    assert str(e.value).count("UCX endpoint create failed") == 3
