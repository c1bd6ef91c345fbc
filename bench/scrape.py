"""Scrapes of the cluster's Prometheus `/metrics` before, during (every --scrape-interval
seconds) and after a run, saved with the result, plus a summary an SRE reads first: peak KV
use and queue depth during the run and the prefix-cache hit rate of the run (counter deltas).

Invariants: only the URLs given are contacted; a failed scrape is recorded (`error`) and
never fails the run; histogram buckets and process/python collector series are dropped to
keep results small.

A `--protect-metrics` endpoint answers only a caller with the cluster secret: scrapes carry it
when one is configured, found as every internal client finds it (runtime/cluster_secret.py:
$DUET_CLUSTER_SECRET_FILE, else $DUET_CLUSTER_SECRET) and sent to the URLs given; else the
running `duet up`'s file ($DUET_HOME/up/cluster.secret, as `duet status` finds it), sent only
to loopback URLs (that cluster's), never to another host the run scrapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from runtime.cluster_secret import (
    ClusterSecret,
    SecretError,
    is_loopback,
    load_secret,
    read_secret_file,
)
from runtime.models import duet_home

_SKIP_PREFIXES = ("python_", "process_")
_SKIP_SUFFIXES = ("_bucket", "_created")


def scrape_secret(env: dict[str, str] | None = None) -> tuple[ClusterSecret | None, bool]:
    """The cluster secret scrapes carry and whether it is the local `duet up`'s (then only
    loopback URLs get it); (None, False) when there is none. Raises
    runtime.cluster_secret.SecretError for a configured one that cannot be used."""
    secret = load_secret(env=env)
    if secret is not None:
        return secret, False
    up = duet_home() / "up" / "cluster.secret"
    try:
        return (read_secret_file(up), True) if up.is_file() else (None, False)
    except SecretError:  # a convenience only: a stale or unreadable file is no secret
        return None, False


def metrics_url(url: str) -> str:
    """A base URL gets `/metrics`; a URL with a path is used as is."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--scrape-metrics URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/") + "/metrics" if urlsplit(url).path in ("", "/") else url


def parse(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(_SKIP_PREFIXES) or s.name.endswith(_SKIP_SUFFIXES):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def _base(key: str) -> str:
    return key.split("{", 1)[0].rsplit(":", 1)[-1]


def _total(samples: dict[str, float], base: str) -> float | None:
    vals = [v for k, v in samples.items() if _base(k) == base]
    return sum(vals) if vals else None


def summarize(scrapes: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [s for s in scrapes if "samples" in s]
    run = [s for s in ok if s["phase"] != "before"]
    out: dict[str, Any] = {"scrapes": len(scrapes), "failed_scrapes": len(scrapes) - len(ok)}
    for base in ("kv_cache_usage_perc", "num_requests_waiting", "num_requests_running"):
        vals = [v for s in run if (v := _total(s["samples"], base)) is not None]
        out[f"max_{base}"] = max(vals) if vals else None
    before = next((s for s in ok if s["phase"] == "before"), None)
    after = next((s for s in reversed(ok) if s["phase"] == "after"), None)
    if before and after:
        delta = {}
        for base in ("prefix_cache_hits_total", "prefix_cache_queries_total"):
            a, b = _total(after["samples"], base), _total(before["samples"], base)
            delta[base] = None if a is None or b is None else a - b
        hits, queries = delta["prefix_cache_hits_total"], delta["prefix_cache_queries_total"]
        out["prefix_cache_hits"] = hits
        out["prefix_cache_queries"] = queries
        out["prefix_cache_hit_rate"] = hits / queries if hits is not None and queries else None
    return out


def _loopback(url: str) -> bool:
    return is_loopback(urlsplit(url).hostname or "")


class Scraper:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        urls: tuple[str, ...],
        interval: float,
        secret: ClusterSecret | None = None,
    ) -> None:
        """`secret`: the one to send to every URL (default: `scrape_secret()`'s, when there are
        URLs)."""
        self._session = session
        self._urls = [metrics_url(u) for u in urls]
        self._interval = interval
        local_only = False
        if secret is None and self._urls:
            secret, local_only = scrape_secret()
        #: each URL's headers: the secret, or none
        self._headers = {
            u: secret.headers if secret is not None and (not local_only or _loopback(u)) else {}
            for u in self._urls
        }
        self.scrapes: dict[str, list[dict[str, Any]]] = {u: [] for u in self._urls}

    async def snapshot(self, phase: str) -> None:
        await asyncio.gather(*(self._one(u, phase) for u in self._urls))

    async def _one(self, url: str, phase: str) -> None:
        entry: dict[str, Any] = {"phase": phase, "t": time.time()}
        try:
            timeout = aiohttp.ClientTimeout(total=max(2.0, self._interval))
            async with self._session.get(
                url, timeout=timeout, allow_redirects=False, headers=self._headers[url]
            ) as r:
                if r.status == 401:
                    raise ValueError(
                        "HTTP 401: a --protect-metrics endpoint "
                        + (
                            "refused the cluster secret sent"
                            if self._headers[url]
                            else "needs the cluster secret ($DUET_CLUSTER_SECRET_FILE)"
                        )
                    )
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
                entry["samples"] = parse(await r.text())
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            entry["error"] = f"{type(e).__name__}: {e}"
        self.scrapes[url].append(entry)

    @contextlib.asynccontextmanager
    async def around(self) -> AsyncIterator[None]:
        """Scrape before, every interval while the body runs, and after."""
        if not self._urls:
            yield
            return
        await self.snapshot("before")

        async def loop() -> None:
            while True:
                await asyncio.sleep(self._interval)
                await self.snapshot("during")

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.snapshot("after")

    def result(self) -> dict[str, Any]:
        return {u: {"summary": summarize(s), "scrapes": s} for u, s in self.scrapes.items()}
