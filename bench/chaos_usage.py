"""`duet bench chaos`'s usage check: the gateway's usage records matched, one by one, to the
requests the client sent.

Totals alone cannot be compared: a request whose answer died with its gateway (the record was
written, the last bytes never arrived), a client that gave up on a hang (`client_disconnected`)
or a booking a restarted gateway billed (`expired`: the prompt, and what its stream had sent by
the dead gateway's last heartbeat) have a record the client never saw answered, while the
client sees answers with no record at all (a 429 refused before any booking). So each request
carries a tag of its own in the OpenAI `user` field (the same on its one retry) and the
answer's X-Request-Id, and the check is per request:
- every full answer has exactly one record: its X-Request-Id, status `ok`, the client's
  completion tokens (`exact`);
- no tag has more than one billed record (`billed_twice`: a retried request whose lost first
  attempt was billed too — each request's attempts share an `Idempotency-Key`, so its retry's
  record replaces the dead attempt's `expired` one — or a record written twice);
- every record belongs to a request the client sent (`unknown`);
- the records of requests the client got no full answer for are counted by status
  (`no_full_answer`): what a team pays for answers it did not get, by cause.

Invariant: figures come from the records and the client's own counts; nothing is inferred.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import msgspec

from bench.chaos_batch import BatchResult
from bench.chaos_load import Outcome, Record

#: the prefix of every chaos request's `user` tag (the references have none)
TAG = "chaos-"


class UsageCheck(msgspec.Struct, kw_only=True):
    #: records of the chaos' requests, by status
    records: dict[str, int] = msgspec.field(default_factory=dict)
    #: full answers (streams, plain requests, batch lines) the client received
    full_answers: int = 0
    #: full answers with exactly one record of theirs: same id, `ok`, same completion tokens
    exact: int = 0
    #: full answers without that record (tag: what was found instead), the first 20
    mismatched: dict[str, str] = msgspec.field(default_factory=dict)
    #: tags with more than one billed record (tag: the statuses), the first 20
    billed_twice: dict[str, list[str]] = msgspec.field(default_factory=dict)
    #: records of requests the client got no full answer for, by status
    no_full_answer: dict[str, int] = msgspec.field(default_factory=dict)
    #: completion tokens those records bill (a stream cut by an error event: the tokens of the
    #: chunks written to the client, which it counts as chunks — equal unless one chunk carried
    #: several tokens, e.g. the bytes of one multi-byte character; a whole answer's 502: none)
    no_full_answer_tokens: int = 0
    #: records with a chaos tag the client never sent
    unknown: int = 0
    retried: int = 0
    #: the records could not be read
    error: str = ""

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and self.exact == self.full_answers
            and not self.billed_twice
            and not self.unknown
        )


def fetch_records(url: str, key: str, start: float) -> list[dict[str, Any]] | str:
    """The team's usage records since `start` (unix seconds), or why they cannot be read: page
    after page, as the gateway hands them out."""
    rows: list[dict[str, Any]] = []
    after: str | None = ""
    while after is not None:
        query = urllib.parse.urlencode(
            {"group_by": "record", "start": f"{start:.3f}", **({"after": after} if after else {})}
        )
        req = urllib.request.Request(
            f"{url}/v1/usage?{query}", headers={"Authorization": f"Bearer {key}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                page = json.loads(r.read())
            rows += page["data"]
            after = page["next"]
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            return f"usage records not readable: {e}"
    return rows


def _billed(row: dict[str, Any]) -> bool:
    """A record the team pays for: priced, or of a request some node served (a model without
    prices costs 0 either way). `error`/`shed` records of requests no node served cost nothing."""
    return bool(row.get("cost_usd")) or row.get("status") not in ("error", "shed")


def check(
    records: list[Record], batch: BatchResult, rows: list[dict[str, Any]] | str
) -> UsageCheck:
    """Match `rows` (the gateway's records) to the client's `records` and the batch's lines."""
    if isinstance(rows, str):
        return UsageCheck(error=rows)
    out = UsageCheck(retried=sum(r.retried for r in records))
    by_tag: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        tag = row.get("user") or ""
        if tag.startswith(TAG):
            by_tag.setdefault(tag, []).append(row)
            out.records[row["status"]] = out.records.get(row["status"], 0) + 1
    # what the client got, per tag: (X-Request-Id or "" for a batch line, completion tokens)
    full: dict[str, tuple[str, int]] = {
        r.tag: (r.request_id, r.tokens) for r in records if r.outcome == Outcome.FULL
    }
    full |= {cid: ("", n) for cid, n in batch.line_tokens.items()}
    sent = {r.tag for r in records} | {f"{TAG}{i}" for i in range(batch.lines)}
    out.full_answers = len(full)
    for tag, found in by_tag.items():
        if tag not in sent:
            out.unknown += len(found)
            continue
        if len([r for r in found if _billed(r)]) > 1 and len(out.billed_twice) < 20:
            out.billed_twice[tag] = [r["status"] for r in found]
        if tag not in full:
            for r in found:
                out.no_full_answer[r["status"]] = out.no_full_answer.get(r["status"], 0) + 1
                out.no_full_answer_tokens += r["completion_tokens"]
    for tag, (rid, tokens) in full.items():
        found = by_tag.get(tag, [])
        mine = [r for r in found if (not rid or r["request_id"] == rid)]
        if len(mine) == 1 and mine[0]["status"] == "ok" and mine[0]["completion_tokens"] == tokens:
            out.exact += 1
        elif len(out.mismatched) < 20:
            out.mismatched[tag] = (
                f"{len(mine)} record(s) of {rid or 'the line'}: "
                + ", ".join(f"{r['status']} {r['completion_tokens']} tokens" for r in mine)
                + f"; the client got {tokens} tokens"
            )
    return out
