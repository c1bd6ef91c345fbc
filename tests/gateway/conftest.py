"""Gateway test fixtures: a real PostgreSQL server (pgserver) and fresh databases on it, and a
gateway in front of one node (one slot, or the tiers a test asks for). The node processes of
the P/D tests are tests/conftest.py's `pd_nodes`; COMMON is their arguments."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.helpers import MODEL, gateway_proc, tiny_model
from tests.procs import TINY_NODE_ARGS as COMMON
from tests.procs import Proc, duet_node, running

__all__ = ["COMMON"]


@pytest.fixture(scope="session")
def postgres() -> Iterator[str]:
    """A real PostgreSQL server (pgserver ships the binaries) on a unix socket; its URI.

    Its data directory is not under pytest's basetemp: run as root, pgserver runs the server as
    the user `pgserver` and opens the path's folders to it, but every pytest session that starts
    on the machine resets /tmp/pytest-of-root to 0700 (pytest's own guard), after which the
    server cannot reach its files and PANICs ("could not open file .../global/pg_control:
    Permission denied"; every later connection is refused). Seen when a second pytest ran beside
    the suite."""
    pgserver = pytest.importorskip("pgserver")
    home = Path(tempfile.mkdtemp(prefix="duet-test-pg-"))
    try:
        srv = pgserver.get_server(home / "data", cleanup_mode="delete")
        try:
            yield srv.get_uri()  # started with `pg_ctl -w`: it accepts connections already
        finally:
            srv.cleanup()
    finally:
        shutil.rmtree(home, ignore_errors=True)


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


@dataclass(frozen=True)
class GatewayOnNode:
    """A real gateway in front of one real node, both running."""

    gateway: Proc
    node: Proc

    @contextmanager
    def node_paused(self) -> Iterator[None]:
        """The node SIGSTOPped for the block: a request the gateway admits meanwhile holds its
        slot until the block ends, however fast the node would have answered it (its kernel
        still acknowledges, and the gateway waits read_timeout_s for a first token)."""
        os.kill(self.node.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.node.proc.pid, signal.SIGCONT)


@contextmanager
def gateway_on_node(tiny_llama: Path, tmp_path: Path, **tiers: Any) -> Iterator[GatewayOnNode]:
    """A real gateway whose `[tiers]` are `tiers` in front of one real node (`both`), running;
    an interactive request may wait up to 300 s for a slot."""
    node = duet_node(
        "both",
        tiny_llama,
        tmp_path,
        "--dtype",
        "float32",
        "--kv-blocks",
        "256",
        "--max-model-len",
        "1024",
    )
    g = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama, both=[node.url])},
        # no reading ahead of the client: the tests hold a slot with a stream they do not read,
        # which a read-ahead would finish at the node and free
        tiers={"interactive_max_wait_s": 300, "stream_read_ahead_bytes": 0, **tiers},
    )
    with running(node, g):
        yield GatewayOnNode(g, node)


@pytest.fixture
def one_slot(tiny_llama: Path, tmp_path: Path) -> Iterator[GatewayOnNode]:
    """A real gateway with one slot (`max_inflight = 1`) in front of one real node
    (`gateway_on_node`). Fresh for each test: the tests count its waits and refusals."""
    with gateway_on_node(tiny_llama, tmp_path, max_inflight=1) as pair:
        yield pair


@pytest.fixture
def one_slot_gateway(one_slot: GatewayOnNode) -> Proc:
    """`one_slot`'s gateway."""
    return one_slot.gateway
