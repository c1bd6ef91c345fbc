"""What `duet up` keeps under `$DUET_HOME` (default ~/.cache/duet), so a restart finds the same
cluster state:

    gateway.db          the gateway's SQLite store: teams, keys, usage (the CLI's default store)
    etcd/               etcd's data directory
    logs/ROLE.log       one log per process (appended across restarts)
    up/gateway.toml     the gateway config `duet up` writes (routes through the coordinator)
    up/dev.key          the development team's API key (0600): printed again on every start
    up/admin.key        the gateway admin key (0600); the gateway only gets its SHA-256
    up/cluster.secret   the cluster secret (0600) every child gets through --cluster-secret-file
    up/state.json       URLs and PIDs of the running cluster, read by `duet status`
    up/lock             held (flock) while a `duet up` runs: one per DUET_HOME

Invariant: secret files are created 0600 before anything is written to them.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from runtime.models import duet_home

DEV_TEAM = "dev"


@dataclass(frozen=True)
class UpHome:
    root: Path

    @classmethod
    def current(cls) -> UpHome:
        return cls(duet_home().resolve())

    @property
    def up(self) -> Path:
        return self.root / "up"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def gateway_toml(self) -> Path:
        return self.up / "gateway.toml"

    @property
    def dev_key_file(self) -> Path:
        return self.up / "dev.key"

    @property
    def admin_key_file(self) -> Path:
        return self.up / "admin.key"

    @property
    def cluster_secret_file(self) -> Path:
        return self.up / "cluster.secret"

    @property
    def state_file(self) -> Path:
        return self.up / "state.json"

    @property
    def store_url(self) -> str:
        return f"sqlite://{self.root / 'gateway.db'}"

    def prepare(self) -> None:
        for d in (self.root, self.up, self.logs, self.etcd_data):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.up, 0o700)

    def lock(self) -> IO[str] | None:
        """The exclusive lock of this DUET_HOME (keep the returned file open), or None when
        another `duet up` holds it."""
        fh = (self.up / "lock").open("a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            return None
        return fh

    # -- state -------------------------------------------------------------------------------
    def write_state(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    def read_state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def clear_state(self) -> None:
        self.state_file.unlink(missing_ok=True)


def read_secret(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def write_secret(path: Path, secret: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)  # an existing file keeps its mode on open: make sure


def admin_key(home: UpHome) -> str:
    """The admin key, created on first start."""
    from gateway.accounts.keys import new_secret

    key = read_secret(home.admin_key_file)
    if key is None:
        key = new_secret().replace("sk-duet-", "sk-duet-admin-", 1)
        write_secret(home.admin_key_file, key)
    return key


def cluster_secret(home: UpHome) -> Path:
    """The cluster secret's file, created on first start (secrets.token_urlsafe(32), 0600) and
    reused while it is valid; one that is not (too short, readable by others, unreadable) is
    replaced: every child of this `duet up` gets the new one, and nothing else shares it."""
    import secrets

    from runtime.cluster_secret import SecretError, read_secret_file, write_secret_file

    path = home.cluster_secret_file
    if path.exists():
        try:
            read_secret_file(path)
            return path
        except SecretError as e:
            print(f"duet up: replacing the cluster secret: {e}", flush=True)
    tmp = path.with_suffix(".tmp")
    write_secret_file(tmp, secrets.token_urlsafe(32))
    tmp.replace(path)
    return path


async def _ensure_dev_key(store_url: str, key_file: Path) -> tuple[str, bool]:
    from gateway.accounts.keys import hash_secret, new_key
    from gateway.accounts.store import open_store
    from gateway.accounts.store.base import Team

    store = open_store(store_url)
    await store.open()
    try:
        secret = read_secret(key_file)
        if secret is not None and await store.key_by_hash(hash_secret(secret)) is not None:
            return secret, False
        if await store.get_team(DEV_TEAM) is None:
            await store.create_team(Team(id=DEV_TEAM, created_at=time.time()))
        # No stored key, or one revoked or from a deleted store: a fresh secret.
        key, secret, digest = new_key(DEV_TEAM, "duet up")
        await store.create_key(key, digest)
        write_secret(key_file, secret)
        return secret, True
    finally:
        await store.close()


def dev_key(home: UpHome) -> tuple[str, bool]:
    """The development team's key (team `dev`, no limits): (secret, created now)."""
    return asyncio.run(_ensure_dev_key(home.store_url, home.dev_key_file))
