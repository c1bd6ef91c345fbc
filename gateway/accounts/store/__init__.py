"""The gateway store, chosen by URL: `sqlite:///path` (default) or `postgresql://...`."""

from __future__ import annotations

from gateway.accounts.store.base import Store


def open_store(url: str) -> Store:
    """A store for `url` (not yet opened: `await store.open()`)."""
    if url.startswith("sqlite:///"):
        from gateway.accounts.store.sqlite import SqliteStore

        path = url.removeprefix("sqlite://")  # sqlite:///abs/path or sqlite:///./relative
        return SqliteStore(path[1:] if path.startswith("//") else path)
    if url.startswith(("postgresql://", "postgres://")):
        from gateway.accounts.store.postgres import PostgresStore

        return PostgresStore(url)
    raise ValueError(f"unsupported store URL {url!r}: use sqlite:///PATH or postgresql://...")
