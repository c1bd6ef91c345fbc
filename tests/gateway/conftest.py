"""Real node processes shared by a gateway test module: one prefill, one decode and one
colocated node on the tiny model (fp32, one thread each). Stopped at the end, pass or fail."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Proc, duet_node, running

COMMON = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def nodes(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("nodes")
    p = duet_node("prefill", tiny_llama, tmp, *COMMON, "--lease-seconds", "30")
    d = duet_node("decode", tiny_llama, tmp, *COMMON)
    both = duet_node("both", tiny_llama, tmp, *COMMON)
    with running(p, d, both):
        yield p, d, both


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real PostgreSQL server (pgserver ships the binaries) on a unix socket; its URI."""
    pgserver = pytest.importorskip("pgserver")
    srv = pgserver.get_server(tmp_path_factory.mktemp("pg"), cleanup_mode="stop")
    try:
        yield srv.get_uri()
    finally:
        srv.cleanup()


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
