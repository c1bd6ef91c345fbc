"""The store's password stays out of logs and the process list: a gateway given a PostgreSQL
DSN with a password, through `--store-url-file` or `$DUET_STORE_URL` (never argv), starts on it
and neither its ready line nor any log line carries the password (`postgresql://u:***@…`); a
store that cannot be opened is reported redacted too.

Real parts: a real PostgreSQL server (pgserver, trust authentication: it takes any password),
`duet gateway`'s own parser and config, and the gateway's `serve` in this process on a real port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from duet.cli import build_parser
from duet.cmd_gateway import _config
from gateway.accounts.store.dsn import redact
from gateway.server import serve
from tests.gateway.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.gateway.helpers import tiny_model, write_config
from tests.procs import free_port
from tests.wait import until

PASSWORD = "hunter2-Zq9xPassword"


def with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    hostport = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"postgres:{password}@{hostport}"))


def test_redact_masks_only_the_password() -> None:
    assert redact("postgresql://duet:s3cr%40t@db:5432/duet?sslmode=require") == (
        "postgresql://duet:***@db:5432/duet?sslmode=require"
    )
    assert redact("postgresql://duet@db/duet") == "postgresql://duet@db/duet"
    assert redact("sqlite:////var/lib/duet/gateway.db") == "sqlite:////var/lib/duet/gateway.db"


async def test_the_password_is_in_no_line_the_gateway_writes(
    postgres_db: str,  # noqa: F811
    tiny_llama: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    dsn = with_password(postgres_db, PASSWORD)
    secret_file = tmp_path / "store-url"
    secret_file.write_text(dsn + "\n")
    port = free_port()
    toml = write_config(
        tmp_path / "gateway.toml",
        {"tiny": tiny_model(tiny_llama, both=["http://127.0.0.1:9"])},
        server={"port": port, "host": "127.0.0.1"},
    )
    argv = ["gateway", "--config", str(toml), "--store-url-file", str(secret_file)]
    cfg = _config(build_parser().parse_args(argv))
    assert cfg.store_url == dsn and PASSWORD not in " ".join(argv)
    monkeypatch.setenv("DUET_STORE_URL", dsn)  # the manifests' way: the Secret as an env var
    assert _config(build_parser().parse_args(["gateway", "--config", str(toml)])).store_url == dsn

    written: list[str] = []  # everything serve printed

    def ready() -> bool:
        out, err = capsys.readouterr()
        written.extend((out, err))
        return "duet gateway ready" in out or task.done()

    task = asyncio.create_task(serve(cfg, grace_s=1))
    await until(ready, 60, "the ready line")
    os.kill(os.getpid(), signal.SIGTERM)  # serve's own handler: a clean stop
    assert await asyncio.wait_for(task, 30) == 0
    written.extend(capsys.readouterr())
    [line] = [ln for ln in "".join(written).splitlines() if "duet gateway ready" in ln]
    assert "store=postgresql://postgres:***@" in line, line
    assert "postgres:***@" in caplog.text, caplog.text  # the start-up log names it, redacted
    assert PASSWORD not in "".join(written) + caplog.text

    # a store that cannot be opened: the failure line names it redacted
    refused = with_password(f"postgresql://127.0.0.1:{free_port()}/duet", PASSWORD)
    assert await serve(dataclasses.replace(cfg, store_url=refused), grace_s=1) == 1
    out, err = capsys.readouterr()
    assert "cannot start" in err and "postgres:***@127.0.0.1" in err and PASSWORD not in err + out
