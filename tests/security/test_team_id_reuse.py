"""A deleted team's id is never given to another team.

Deleting a team revoked its keys but kept its usage records, spend, batch files and results and
prefix-cache domain under its id; a new customer created with the same id inherited all of it
(the old team's prompts, outputs, `user` ids and spend). The id is now tombstoned: creating a
team with it is a 409 that says why, on both stores, and an id that never existed stays free.

Real parts: a gateway process and its admin API; the SQLite and PostgreSQL stores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.accounts.store import open_store
from gateway.accounts.store.base import StoreError, Team
from tests.gateway.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.gateway.helpers import gateway_proc, http, make_team, tiny_model
from tests.procs import Proc, running


@pytest.fixture(scope="module")
def gw(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("reuse")
    g = gateway_proc(tmp, {"tiny": tiny_model(tiny_llama, both=["http://127.0.0.1:9"])})
    with running(g):
        yield g


def test_a_deleted_teams_id_is_refused_with_409(gw: Proc) -> None:
    old_key = make_team(gw.url, "acme")
    assert http(f"{gw.url}/v1/models", key=old_key)[0] == 200
    assert http(f"{gw.url}/admin/teams/acme", "DELETE")[0] == 200
    status, _, body = http(f"{gw.url}/admin/teams", "POST", {"id": "acme"})
    assert status == 409, body
    assert "deleted team" in body["error"]["message"], body
    assert http(f"{gw.url}/v1/models", key=old_key)[0] == 401
    make_team(gw.url, "acme-2")  # another id is free


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'g.db'}"
    return request.getfixturevalue("postgres_db")


async def test_both_stores_tombstone_a_deleted_id(url: str) -> None:
    store = open_store(url)
    await store.open()
    try:
        await store.create_team(Team(id="acme"))
        assert await store.delete_team("acme")
        with pytest.raises(StoreError) as e:
            await store.create_team(Team(id="acme"))
        assert e.value.status == 409 and "deleted team" in str(e.value)
        assert not await store.delete_team("never")  # nothing deleted: nothing tombstoned
        await store.create_team(Team(id="never"))
        with pytest.raises(StoreError) as e:
            await store.create_team(Team(id="never"))
        assert e.value.status == 409 and "already exists" in str(e.value)
    finally:
        await store.close()
