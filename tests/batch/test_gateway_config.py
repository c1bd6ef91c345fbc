"""`[batch]` in gateway.toml: defaults, validation, and where the batch store lives."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from gateway.batch.wiring import batch_config, data_dir
from gateway.config import ConfigError, parse_config

MODELS = {"m": {"kind": "cluster", "tokenizer": "x", "static": {"both": ["http://127.0.0.1:1"]}}}


def cfg(**sections: Any) -> Any:
    return parse_config({"models": MODELS, **sections})


def test_defaults_put_the_batch_store_next_to_the_gateway_store(tmp_path: Path) -> None:
    c = cfg(store={"url": f"sqlite://{tmp_path}/gw/gateway.db"}, server={"port": 8123})
    assert c.batch.enabled and c.batch.discount == 0.5
    assert data_dir(c) == tmp_path / "gw" / "batch"
    bc = batch_config(c)
    assert bc.files_dir == tmp_path / "gw" / "batch" / "files"
    assert (
        bc.worker_id == f"{socket.gethostname()}:8123"
    )  # stable across a restart on the same port
    assert bc.models == frozenset({"m"})


def test_settings_pass_through(tmp_path: Path) -> None:
    c = cfg(
        batch={
            "concurrency": 3,
            "discount": 0.3,
            "data_dir": str(tmp_path / "b"),
            "callback_secret": "s",
            "callback_secrets": {"team-x": "t"},
            "allow_private_callbacks": True,
            "worker_id": "w1",
        }
    )
    bc = batch_config(c)
    assert (bc.concurrency, bc.worker_id, bc.allow_private_callbacks) == (3, "w1", True)
    assert bc.callback_secret_for("team-x") == "t" and bc.callback_secret_for("team-y") == "s"
    assert data_dir(c) == tmp_path / "b"


def test_postgres_gateway_store_defaults_to_duet_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DUET_HOME", str(tmp_path))
    c = cfg(store={"url": "postgresql://u@h/db"})
    assert data_dir(c) == tmp_path / "batch"


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"discount": 1.5}, "discount"),
        ({"discount": -0.1}, "discount"),
        ({"concurrency": -1}, "concurrency"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"callback_secrets": {"t": 1}}, "callback_secrets"),
        ({"discont": 0.5}, "unknown keys: discont"),
    ],
)
def test_bad_settings_are_refused(bad: dict[str, Any], msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        cfg(batch=bad)
