"""The gateway's one store, chosen by URL: `sqlite:///path` (default) or `postgresql://...`.

One interface (`Store`, base.py) over the accounts' tables and the batch tier's
(batch_tables.py). On SQLite the accounts' tables are in the URL's file and the batch tier's in
`batch.sqlite3` in the batch data directory, the files earlier versions wrote; on PostgreSQL
every table is in the URL's database, on one pool.
"""

from __future__ import annotations

from pathlib import Path

from gateway.accounts.store.base import Store
from gateway.accounts.store.dsn import redact


def open_store(url: str, batch_dir: Path | None = None) -> Store:
    """A store for `url` (not yet opened: `await store.open()`); `batch_dir`: where SQLite keeps
    the batch tier's file (default: `batch/` beside the store's file)."""
    if url.startswith("sqlite:///"):
        from gateway.accounts.store.sqlite import SqliteStore

        path = url.removeprefix("sqlite://")  # sqlite:///abs/path or sqlite:///./relative
        batch = batch_dir / "batch.sqlite3" if batch_dir is not None else None
        return SqliteStore(path[1:] if path.startswith("//") else path, batch)
    if url.startswith(("postgresql://", "postgres://")):
        from gateway.accounts.store.postgres import PostgresStore

        return PostgresStore(url)
    raise ValueError(
        f"unsupported store URL {redact(url)!r}: use sqlite:///PATH or postgresql://..."
    )
