"""Usage totals per group, computed by the database (`Store.usage`): one SQL statement that
both stores run, so SQLite and PostgreSQL give the same rows and no caller reads a range's
records to add them up (the console's Usage page and `duet usage report` share these rows).

A row holds the group's requests, tokens (prompt, completion, cache reads and writes) and
cost, and its time to first token at the 50th and 90th percentile. The percentile is the
nearest rank: of the group's n TTFTs in order, the one at rank min(n, floor(q·n) + 1), 1-based —
computed with integer arithmetic (n·5/10, n·9/10) so both databases pick the same record; None
when no request of the group had a first token.

Invariant: the statement's result has one row per group (one row in all without a group), so
what the caller receives is bounded by the number of groups, never by the number of records.

`outliers_sql`: a range's failed requests and its slowest tenth (latency at or above the
range's nearest-rank P90, once it has 10 records), newest first, at most a limit — the
console's Requests page, which must not read a day of records to find a hundred.
"""

from __future__ import annotations

from typing import Any

#: (row field, tenths): the TTFT percentiles every row carries, in seconds like `ttft_s`
PERCENTILES = (("ttft_p50_s", 5), ("ttft_p90_s", 9))


def group_keys(group_by: str | None, day: str, user: str) -> list[tuple[str, str]]:
    """The (SQL expression, row name) of a `GROUP_BY` value (None: no group): `day` and `user`
    are the database's own (a date from epoch seconds; `user`, quoted where it is reserved)."""
    return {
        None: [],
        "model": [("model_requested", "model")],
        "day": [(day, "date")],
        "team": [("team_id", "team_id")],
        "tier": [("tier", "tier")],
        "user": [(user, "user")],
        "adapter": [("adapter", "adapter")],
        "version": [("model_used", "model"), ("version", "version")],
    }[group_by]


def totals_sql(keys: list[tuple[str, str]], where: str, least: str, nulls_first: str) -> str:
    """The statement for groups `keys` ((SQL expression, row name), in order), records matching
    `where`. `least`: the database's two-argument minimum (SQLite `min`, PostgreSQL `LEAST`);
    `nulls_first`: what follows a group in ORDER BY to put NULL first (SQLite does by default)."""
    inner = [f"{expr} AS g{i}" for i, (expr, _) in enumerate(keys)]
    groups = [f"g{i}" for i in range(len(keys))]
    part = ", ".join(
        expr for expr, _ in keys
    )  # the expressions: a window cannot name its SELECT's aliases
    # row_number over the group's records that have a TTFT (the IS NULL partition keeps the
    # others apart), count over the group: the rank of each TTFT and how many there are
    window = (
        f"row_number() OVER (PARTITION BY {part + ', ' if part else ''}ttft_s IS NULL ORDER BY "
        f"ttft_s) AS rn, count(ttft_s) OVER ({'PARTITION BY ' + part if part else ''}) AS nt"
    )
    pct = [
        f"max(CASE WHEN ttft_s IS NOT NULL AND rn = {least}(nt, nt * {tenths} / 10 + 1) THEN "
        f"ttft_s END) AS {name}"
        for name, tenths in PERCENTILES
    ]
    outer = [
        *(f'g{i} AS "{name}"' for i, (_, name) in enumerate(keys)),
        "count(*) AS n",
        "coalesce(sum(prompt_tokens), 0) AS p",
        "coalesce(sum(completion_tokens), 0) AS c",
        "coalesce(sum(cached_tokens), 0) AS k",
        "coalesce(sum(cache_write_tokens), 0) AS w",
        "coalesce(sum(cost_usd), 0) AS cost",
        *pct,
    ]
    sql = (
        f"SELECT {', '.join(outer)} FROM (SELECT "
        f"{', '.join([*inner, 'prompt_tokens', 'completion_tokens'])}, cached_tokens, "
        f"cache_write_tokens, cost_usd, ttft_s, {window} FROM usage WHERE {where}) AS u"
    )
    if groups:
        sql += (
            f" GROUP BY {', '.join(groups)} ORDER BY {', '.join(g + nulls_first for g in groups)}"
        )
    return sql


def totals_row(names: list[str], row: Any) -> dict[str, Any]:
    """A result row (a tuple, or a record indexable by position) as the API's usage row."""
    d: dict[str, Any] = {name: row[i] for i, name in enumerate(names)}
    n, p, c, cached, written, cost, *pcts = (
        row[i] for i in range(len(names), len(names) + 6 + len(PERCENTILES))
    )
    d.update(
        requests=n,
        prompt_tokens=int(p),
        completion_tokens=int(c),
        cached_tokens=int(cached),
        cache_write_tokens=int(written),
        total_tokens=int(p + c),
        cost_usd=round(float(cost), 10),
    )
    d.update({name: v for (name, _), v in zip(PERCENTILES, pcts, strict=True)})
    return d


#: records a range needs before it has a slowest tenth (fewer: only its failed requests)
OUTLIER_MIN_RECORDS = 10


def outliers_sql(columns: str, where: str, least: str, limit: str) -> str:
    """The statement for the outliers of the records matching `where` (which the statement uses
    twice: a positional-parameter database passes its arguments twice), `columns` of each,
    `limit` the placeholder of the row limit."""
    return (
        "WITH r AS (SELECT latency_s, row_number() OVER (ORDER BY latency_s) AS rn, count(*) OVER "
        f"() AS n FROM usage WHERE {where}), cut AS (SELECT max(CASE "
        f"WHEN n >= {OUTLIER_MIN_RECORDS} AND rn = {least}(n, n * 9 / 10 + 1) "
        f"THEN latency_s END) AS p90 FROM r) SELECT {columns} FROM usage, cut WHERE {where} "
        f"AND (status != 'ok' OR latency_s >= cut.p90) ORDER BY created_at DESC LIMIT {limit}"
    )
