"""`python -m bench.batch_listing`: what listing a team's batches costs the store, the way
`GET /v1/batches?limit=100` reads them (the request counts its batches' rows keep), against
counting each listed batch's lines (what the store did before the counts were columns). One
SQLite batch store in a temporary directory, --batches batches of --lines lines; the best of
--rounds rounds of each, alternated in one process, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from pathlib import Path

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.models import RequestCounts
from gateway.batch.rows import BATCH_COLS, BatchRow, NewRequest

#: the per-batch count the listing made before
COUNT_LINES = "SELECT state, COUNT(*) FROM batch_requests WHERE batch_id=? GROUP BY state"


def _batch(id_: str) -> BatchRow:
    return BatchRow(
        id=id_,
        team_id="t",
        kind="openai",
        endpoint="/v1/completions",
        input_file_id="f",
        completion_window="24h",
        status="in_progress",
        priority=1,
        metadata=None,
        errors=None,
        total=0,
        output_file_id=None,
        error_file_id=None,
        created_at=0.0,
        in_progress_at=0.0,
        expires_at=1e12,
        finalizing_at=None,
        completed_at=None,
        failed_at=None,
        expired_at=None,
        cancelling_at=None,
        cancelled_at=None,
        callback_url=None,
        callback_state=None,
        callback_attempts=0,
        counts=RequestCounts(),
    )


async def run(batches: int, lines: int, rounds: int) -> tuple[float, float]:
    """(seconds of the listing, seconds of counting each listed batch's lines), best of each."""
    path = Path(tempfile.mkdtemp()) / "batch.sqlite3"
    store = SqliteBatchStore(path)
    try:
        for b in range(batches):
            reqs = (NewRequest(line=i + 1, custom_id=f"c{i}", body="{}") for i in range(lines))
            await store.create_batch(_batch(f"batch_{b}"), reqs)
        db = sqlite3.connect(path)
        listing, counting = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            await store.list_batches("t", None, 100)
            listing.append(time.perf_counter() - t)
            t = time.perf_counter()
            q = f"SELECT {BATCH_COLS} FROM batches WHERE team_id='t' ORDER BY seq DESC LIMIT 101"
            for r in db.execute(q).fetchall()[:100]:
                dict(db.execute(COUNT_LINES, (r[0],)).fetchall())
            counting.append(time.perf_counter() - t)
        db.close()
        return min(listing), min(counting)
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, default=100, help="batches of the team (default 100)")
    ap.add_argument("--lines", type=int, default=5000, help="lines per batch (default 5000)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each (default 5)")
    a = ap.parse_args()
    listing, counting = asyncio.run(run(a.batches, a.lines, a.rounds))
    print(
        f"{a.batches} batches x {a.lines} lines: listing {listing * 1e3:.1f} ms, "
        f"counting each batch's lines {counting * 1e3:.1f} ms, {counting / listing:.0f}x"
    )


if __name__ == "__main__":
    main()
