"""`python -m bench.batch_claims`: what one claim of --claim lines (the runner's next lines)
costs the store under its write lock, with many long batches open: the claim as it reads now
(each team's first lines off an index, gateway/accounts/store/claim_order.py) against the one
ranked query it ran before (a window over every claimable line of every open batch, and the
latest start over all their lines), kept here as the baseline. One SQLite batch store in a
temporary directory, --batches in-progress batches of --lines lines over --teams teams, a tenth
of each batch already finished; each round times both picks on the same state (the old query
only selects; the new one then claims, and its lines are handed back so the next round finds
the same store), alternated in one process; the best of --rounds rounds of each, and their
ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.batch_listing import _batch
from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.rows import CLAIM_COLS

#: the claim's selection before, params (now x4, n)
OLD_PICK = (
    f"SELECT {CLAIM_COLS} FROM (SELECT {CLAIM_COLS}, b.priority AS prio, b.seq AS bseq, "
    "  COALESCE(k.busy, 0) + ROW_NUMBER() OVER ("
    "    PARTITION BY b.team_id ORDER BY b.priority DESC, b.seq, r.line) AS turn, "
    "  COALESCE(l.served, -1) AS served "
    "  FROM batch_requests r JOIN batches b ON b.id = r.batch_id LEFT JOIN ("
    "    SELECT b2.team_id, COUNT(*) AS busy FROM batch_requests r2 JOIN batches b2 "
    "ON b2.id = r2.batch_id "
    "    WHERE r2.state='running' AND r2.lease_until>=? GROUP BY b2.team_id) k "
    "ON k.team_id = b.team_id "
    "  LEFT JOIN ("
    "    SELECT b3.team_id, MAX(r3.started_at) AS served FROM batch_requests r3 "
    "    JOIN batches b3 ON b3.id = r3.batch_id WHERE b3.status='in_progress' "
    "GROUP BY b3.team_id"
    "  ) l ON l.team_id = b.team_id "
    "  WHERE b.status='in_progress' AND b.expires_at>? AND ("
    "  (r.state='pending' AND r.not_before<=?) OR (r.state='running' "
    "AND r.lease_until<?))) r JOIN batches b ON b.id = r.batch_id "
    "ORDER BY r.prio DESC, r.turn, r.served, r.bseq, r.line LIMIT ?"
)
#: a batch's lines, made in the database (a tenth of them done: the claim must step over
#: finished lines too)
_LINES = (
    "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM s WHERE i<:lines) "
    "INSERT INTO batch_requests (batch_id, custom_id, line, body, state, started_at, finished_at) "
    "SELECT :id, 'c' || i, i, '{}', CASE WHEN i<=:done THEN 'succeeded' ELSE 'pending' END, "
    "CASE WHEN i<=:done THEN 1.0 END, CASE WHEN i<=:done THEN 2.0 END FROM s"
)


async def _fill(store: SqliteBatchStore, db: sqlite3.Connection, a: argparse.Namespace) -> None:
    for b in range(a.batches):
        row = replace(_batch(f"batch_{b}"), team_id=f"t{b % a.teams}", priority=1 + b % 2)
        await store.create_batch(row, [])
        with db:
            db.execute(_LINES, {"lines": a.lines, "id": row.id, "done": a.lines // 10})


async def run(a: argparse.Namespace) -> tuple[float, float]:
    """(seconds of the claim now, seconds of the old pick), best of each."""
    path = Path(tempfile.mkdtemp()) / "batch.sqlite3"
    store = SqliteBatchStore(path)
    db = sqlite3.connect(path)
    try:
        await _fill(store, db, a)
        new, old = [], []
        for i in range(a.rounds):
            now = 100.0 + i
            t = time.perf_counter()
            got = await store.claim_requests("bench", a.claim, lease_s=60.0, now=now)
            new.append(time.perf_counter() - t)
            assert len(got) == a.claim, got
            await store.release_claims("bench")
            t = time.perf_counter()
            db.execute(OLD_PICK, (now, now, now, now, a.claim)).fetchall()
            old.append(time.perf_counter() - t)
        return min(new), min(old)
    finally:
        db.close()
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, default=100, help="open batches (default 100)")
    ap.add_argument("--lines", type=int, default=20_000, help="lines per batch (default 20000)")
    ap.add_argument("--teams", type=int, default=10, help="teams owning them (default 10)")
    ap.add_argument("--claim", type=int, default=8, help="lines per claim (default 8)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each (default 2)")
    a = ap.parse_args()
    new, old = asyncio.run(run(a))
    print(
        f"{a.batches} batches x {a.lines} lines, {a.teams} teams, claim of {a.claim}: "
        f"now {new * 1e3:.2f} ms, before {old * 1e3:.1f} ms, {old / new:.0f}x"
    )


if __name__ == "__main__":
    main()
