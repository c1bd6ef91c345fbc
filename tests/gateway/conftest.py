"""Gateway test fixtures: a real PostgreSQL server (pgserver) and fresh databases on it. The
node processes are tests/conftest.py's `pd_nodes`; COMMON is their arguments."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.procs import TINY_NODE_ARGS as COMMON
from tests.wait import wait_for

__all__ = ["COMMON"]


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real PostgreSQL server (pgserver ships the binaries) on a unix socket; its URI."""
    pgserver = pytest.importorskip("pgserver")
    srv = pgserver.get_server(tmp_path_factory.mktemp("pg"), cleanup_mode="stop")
    try:
        uri = srv.get_uri()
        _wait_accepting(uri, timeout=60.0)
        yield uri
    finally:
        srv.cleanup()


def _wait_accepting(uri: str, timeout: float) -> None:
    """Until the server takes a connection: pgserver can return before its socket accepts (a CI
    run on a loaded machine got "connection refused" on the first connect)."""
    import asyncio

    import asyncpg

    async def probe() -> None:
        con = await asyncpg.connect(uri, timeout=5)
        await con.close()

    def accepts() -> bool:
        try:
            asyncio.run(probe())
        except (OSError, asyncpg.CannotConnectNowError):
            return False
        return True

    wait_for(accepts, timeout, f"PostgreSQL at {uri} to accept a connection")


@pytest.fixture
def postgres_db(postgres: str) -> str:
    """A fresh, empty database on the shared server; its URI."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    import asyncio

    import asyncpg

    async def create() -> None:
        con = await asyncpg.connect(postgres)
        try:
            await con.execute(f"CREATE DATABASE {name}")
        finally:
            await con.close()

    asyncio.run(create())
    return postgres.replace("/postgres?", f"/{name}?")
