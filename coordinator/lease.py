"""`LeaseHolder`: one etcd lease kept alive, and the keys that live on it — the one loop behind
a coordinator replica's membership and election (election.py) and a node's registration
(node/registration.py).

A session: grant a lease of `ttl` seconds, `attach` (write the keys bound to it, and return the
watchers that run while it is held), then refresh the lease every TTL/3 while calling `tick`
every `tick_s`. The session ends when the lease is gone (keepalive answers 0: etcd restarted
empty, a long partition), when a watcher returns (its key was deleted), or when `tick` says so;
the next session starts at once. A refresh has a deadline of its own
(TTL/6, at least 0.5 s); one that fails is tried again on the same lease for as long as the lease
may still live on etcd's side (`expires_by`): with several etcd members, a refresh sent to a
frozen or cut-off one fails alone and the next goes to another, and on a loaded machine a refresh
may miss its deadline several times running. Only a lease that is surely gone (etcd answers 0, or
`expires_by` has passed) ends the session: a new lease would drop the keys on the old one, a
node's registration, under an etcd that kept its quorum. While the store is unreachable
(`StoreError`) sessions are retried with a backoff of 0.2 s doubling to 2 s, and `on_down` is
told; `on_up` once a session holds its lease again. A bug (any other exception) is logged and
retried after 1 s: it must not leave the holder silently out of the cluster.

`valid_until` (monotonic) is how long the lease surely lives on etcd's side: the time the last
grant or refresh that etcd answered was *sent*, plus the TTL etcd gave it. etcd counts from when
it received the call, later than that, so past `valid_until` the holder can no longer prove it
holds its keys — a partition or a SIGSTOP may have let the lease expire and another replica
take them — even though no call has failed yet (a call to a silent etcd fails only after its
deadline, which may be longer than the TTL). Whoever acts on holding the lease (the elected
leader, election.py) checks `valid_until`; the session itself lasts until `expires_by`, the time
the last answer came back plus the TTL it gave, past which etcd has surely expired the lease.

Invariant: at most one session runs at a time, and every task a session started is cancelled
and awaited before the next one starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

from coordinator.store import Store, StoreError

log = logging.getLogger("duet.coordinator.lease")
_BACKOFF_MIN_S = 0.2
_BACKOFF_MAX_S = 2.0

Watcher = Coroutine[Any, Any, None]


class LeaseHolder:
    """Subclasses write their keys in `attach` and may override the hooks."""

    def __init__(self, store: Store, ttl: int, what: str, tick_s: float | None = None) -> None:
        self.store = store
        self.ttl = ttl
        #: for logs: whose lease this is ("coordinator replica c1", "/duet/.../nodes/...")
        self.what = what
        self.tick_s = tick_s if tick_s is not None else ttl / 3
        self.lease = 0
        self._backoff = _BACKOFF_MIN_S
        #: monotonic time until which the lease surely exists (see the module docstring)
        self.valid_until = 0.0
        #: monotonic time past which the lease is surely expired on etcd's side
        self.expires_by = 0.0

    # -- hooks -----------------------------------------------------------------------------
    async def attach(self) -> list[Watcher]:
        """Write what lives on `self.lease` (just granted); the watchers to run while it is held."""
        return []

    async def tick(self) -> bool:
        """Called every `tick_s` while the lease is held; True ends the session."""
        return False

    def on_up(self) -> None:
        """A session holds its lease (after `attach`)."""

    def on_down(self, error: Exception) -> None:
        """The session failed (a StoreError, or a bug, already logged); the next one is
        retried after a backoff."""

    def on_session_end(self) -> None:
        """A session ended, for any reason (its tasks are cancelled already)."""

    def finished(self) -> bool:
        """Checked after each session: True ends `run` (a drained node exiting)."""
        return False

    # -- the loop --------------------------------------------------------------------------
    async def _keepalive(self) -> None:
        next_refresh = time.monotonic() + self.ttl / 3
        while True:
            if await self.tick():
                return
            if time.monotonic() >= next_refresh:
                sent = time.monotonic()
                deadline = max(0.5, self.ttl / 6)
                try:
                    left = await self.store.keepalive(self.lease, timeout=deadline)
                except StoreError as e:
                    if time.monotonic() + deadline >= self.expires_by:
                        raise  # surely gone before another try could answer: start over
                    log.info("etcd lease of %s: refresh failed (%s); trying again", self.what, e)
                    next_refresh = time.monotonic() + _BACKOFF_MIN_S
                    await asyncio.sleep(_BACKOFF_MIN_S)
                    continue
                if left <= 0:
                    log.warning(
                        "etcd lease of %s is gone (etcd restarted empty?); joining again", self.what
                    )
                    return
                self.valid_until = sent + left
                self.expires_by = time.monotonic() + left
                next_refresh = time.monotonic() + self.ttl / 3
            await asyncio.sleep(min(self.tick_s, max(0.0, next_refresh - time.monotonic())))

    async def _session(self) -> None:
        sent = time.monotonic()
        self.lease = await self.store.grant(self.ttl)
        self.valid_until = sent + self.ttl
        self.expires_by = time.monotonic() + self.ttl
        watchers = await self.attach()
        self._backoff = _BACKOFF_MIN_S
        self.on_up()
        tasks = [asyncio.create_task(w) for w in watchers] + [
            asyncio.create_task(self._keepalive())
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.valid_until = self.expires_by = 0.0
            self.on_session_end()
        for t in done:
            t.result()  # re-raise a StoreError

    async def run(self) -> None:
        while True:
            try:
                await self._session()
                if self.finished():
                    return
            except StoreError as e:
                self.on_down(e)
                await asyncio.sleep(self._backoff)
                self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)
            except Exception as e:
                log.exception("etcd lease of %s: unexpected failure; joining again", self.what)
                self.on_down(e)
                await asyncio.sleep(1.0)

    async def release(self) -> None:
        """Revoke the lease now (clean shutdown): every key on it goes at once, nobody waits
        for the TTL."""
        lease, self.lease = self.lease, 0
        if lease:
            with contextlib.suppress(StoreError):
                await self.store.revoke(lease)
