"""Which lines a claim takes next (`claim_requests`, sqlite_batch_claims.py and
postgres_batch_claims.py): the same lines, in the same order, as one ranked query over every
claimable line would give, read in time that grows with the open batches and the claim's size,
not with the lines they hold.

The order:
- a candidate is a line of an `in_progress` batch not past its `expires_at`, either pending
  with `not_before` reached or running with its lease lapsed;
- a team's own queue is its candidates by batch priority (high first), batch seq, line;
- `turn` = the team's lines running under a live lease (in any of its batches) + the line's
  rank in that queue: round-robin over teams, so one team's huge batch cannot starve another;
- `served` = the latest `started_at` of the team's `in_progress` batches' lines (-1: never):
  equal turns go to the team served longest ago, so a runner claiming one line at a time
  alternates teams;
- the claim is the first n by (priority high first, turn, served, batch seq, line).

Why a team's first n suffice: within a team, priority and turn both only grow along its queue,
so every line ahead of one in its team's queue is ahead of it in the claim order too. A line
behind n others of its team is never among the first n. So each team's queue is read batch by
batch (each batch a range of the (batch_id, state, line) index, pending and lapsed-running
lines being two ranges) until it has n lines, and the teams' prefixes merged here.

SQLite (`pick`): every query is an index read (tests/batch/test_claim_order.py checks their
plans); they run inside the claim's write transaction, so they see one state.

PostgreSQL (`POSTGRES_CLAIM`): one statement, so the pick, its row locks and the update share
one snapshot, and `FOR UPDATE ... SKIP LOCKED` still locks in the fair order, taking the next
lines past those another gateway is claiming. Each open batch gives its first `depth` lines
(a LATERAL range read), and each team keeps its first `depth` of those, which rank exactly as in
the full order (a line whose team's earlier batch was cut is behind `depth` lines of its team).
`depth` = 2n: the lines another gateway holds locked mid-claim are skipped and the claim still
fills from the exact order while each team has fewer than n of them; past that it takes fewer
lines, never others, and the runner's next poll takes the rest.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from gateway.batch.rows import CLAIM_COLS

#: the open batches: their team, priority, seq, and whether they are still within their window
OPEN_BATCHES = (
    "SELECT id, team_id, priority, seq, expires_at>? FROM batches WHERE status='in_progress'"
)
#: the teams' lines running under a live lease (few: bounded by the runners' concurrency)
BUSY = (
    "SELECT b.team_id, COUNT(*) FROM batch_requests r JOIN batches b ON b.id=r.batch_id "
    "WHERE r.state='running' AND r.lease_until>=? GROUP BY b.team_id"
)
#: a batch's latest start (the (batch_id, started_at) index's last entry)
SERVED = "SELECT MAX(started_at) FROM batch_requests WHERE batch_id=?"
#: a batch's first `limit` candidates in line order: its due pending lines, and its running
#: lines whose lease lapsed; each a range of the (batch_id, state, line) index, so finished
#: lines (most of a long batch's) are never read. The unary `+` keeps SQLite off the
#: (state, not_before) index, which would read every due pending line of every batch.
CANDIDATES = (
    "SELECT line, custom_id FROM (SELECT line, custom_id FROM batch_requests WHERE batch_id=? "
    "AND state='pending' AND +not_before<=? ORDER BY line LIMIT ?) UNION ALL "
    "SELECT line, custom_id FROM (SELECT line, custom_id FROM batch_requests WHERE batch_id=? "
    "AND state='running' AND +lease_until<? ORDER BY line LIMIT ?) ORDER BY 1 LIMIT ?"
)
#: a picked line's claim columns (by its primary key)
LINE = (
    f"SELECT {CLAIM_COLS} FROM batch_requests r JOIN batches b ON b.id=r.batch_id "
    "WHERE r.batch_id=? AND r.custom_id=?"
)

#: the PostgreSQL claim: $1 now, $2 n, $3 the worker, $4 its lease's end, $5 the depth
POSTGRES_CLAIM = (
    "WITH o AS (SELECT id, team_id, priority, seq, expires_at FROM batches "
    "  WHERE status='in_progress'), "
    "k AS (SELECT b.team_id, COUNT(*) AS busy FROM batch_requests r JOIN batches b "
    "  ON b.id=r.batch_id WHERE r.state='running' AND r.lease_until>=$1 GROUP BY b.team_id), "
    "l AS (SELECT o.team_id, MAX((SELECT MAX(r.started_at) FROM batch_requests r "
    "  WHERE r.batch_id=o.id)) AS served FROM o GROUP BY o.team_id), "
    "c AS (SELECT o.team_id, o.id AS batch_id, o.priority, o.seq, x.custom_id, x.line FROM o "
    "  CROSS JOIN LATERAL ((SELECT r.custom_id, r.line FROM batch_requests r "
    "  WHERE r.batch_id=o.id AND r.state='pending' AND r.not_before<=$1 ORDER BY r.line "
    "  LIMIT $5) UNION ALL (SELECT r.custom_id, r.line FROM batch_requests r "
    "  WHERE r.batch_id=o.id AND r.state='running' AND r.lease_until<$1 ORDER BY r.line "
    "  LIMIT $5)) x WHERE o.expires_at>$1), "
    "q AS (SELECT c.batch_id, c.custom_id, c.priority, c.seq, c.line, ROW_NUMBER() OVER ("
    "  PARTITION BY c.team_id ORDER BY c.priority DESC, c.seq, c.line) AS rank, "
    "  COALESCE(k.busy, 0) AS busy, COALESCE(l.served, -1) AS served FROM c "
    "  LEFT JOIN k ON k.team_id=c.team_id LEFT JOIN l ON l.team_id=c.team_id), "
    "p AS (SELECT r.batch_id, r.custom_id FROM batch_requests r JOIN q "
    "  ON q.batch_id=r.batch_id AND q.custom_id=r.custom_id WHERE q.rank<=$5 "
    "  AND ((r.state='pending' AND r.not_before<=$1) OR (r.state='running' AND r.lease_until<$1)) "
    "  ORDER BY q.priority DESC, q.busy + q.rank, q.served, q.seq, q.line LIMIT $2 "
    "  FOR UPDATE OF r SKIP LOCKED) "
    "UPDATE batch_requests r SET state='running', claimed_by=$3, lease_until=$4, "
    "attempts=r.attempts+1, started_at=$1, "
    # a rerun keeps its key (rows.Claimed.request_id)
    "request_id=COALESCE(r.request_id, 'batch-' || replace(gen_random_uuid()::text, '-', '')) "
    "FROM p, batches b WHERE r.batch_id=p.batch_id AND r.custom_id=p.custom_id "
    "AND b.id=r.batch_id "
)

#: an open batch: (id, team_id, priority, seq, live)
Batch = tuple[str, str, int, int, int]
#: a candidate's claim-order key and its (batch_id, custom_id)
Keyed = tuple[tuple[int, int, float, int, int], tuple[str, str]]


def pick(db: sqlite3.Connection, n: int, now: float) -> list[tuple[str, str]]:
    """The (batch_id, custom_id) of the next `n` lines to claim, in claim order."""
    teams: dict[str, list[Batch]] = {}
    for b in db.execute(OPEN_BATCHES, (now,)).fetchall():
        teams.setdefault(b[1], []).append(b)
    busy: dict[str, int] = dict(db.execute(BUSY, (now,)).fetchall())
    keyed: list[Keyed] = []
    for team, batches in teams.items():
        keyed += _team_keys(db, batches, busy.get(team, 0), n, now)
    keyed.sort()
    return [k for _, k in keyed[:n]]


def _team_keys(
    db: sqlite3.Connection, batches: list[Batch], busy: int, n: int, now: float
) -> list[Keyed]:
    """The claim-order keys of the team's first `n` candidates (none: the team is not read on)."""
    queue = _team_queue(db, batches, n, now)
    if not queue:
        return []
    served = _served(db, batches)
    return [
        ((-prio, busy + rank, served, seq, line), (bid, cid))
        for rank, (prio, seq, line, bid, cid) in enumerate(queue, 1)
    ]


def _team_queue(
    db: sqlite3.Connection, batches: list[Batch], n: int, now: float
) -> list[tuple[int, int, int, str, str]]:
    """The team's first `n` candidates in its own order: (priority, seq, line, batch, custom_id)."""
    out: list[tuple[int, int, int, str, str]] = []
    for bid, _team, prio, seq, live in sorted(batches, key=lambda b: (-b[2], b[3])):
        if len(out) >= n:
            break
        if live:
            need = n - len(out)
            found = db.execute(CANDIDATES, (bid, now, need, bid, now, need, need)).fetchall()
            out += [(prio, seq, line, bid, cid) for line, cid in found]
    return out


def _served(db: sqlite3.Connection, batches: Sequence[Batch]) -> float:
    """The team's latest start over all its in-progress batches (past their window too); -1:
    none started yet. Read per batch off the index rather than kept on the batch's row: no
    column to add and backfill, and it stays right whoever writes `started_at`."""
    starts = [db.execute(SERVED, (b[0],)).fetchone()[0] for b in batches]
    return max((s for s in starts if s is not None), default=-1)
