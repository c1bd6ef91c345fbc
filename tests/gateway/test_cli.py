"""The operator commands on the gateway's store: `duet teams`, `duet keys`, `duet usage
report`, and `duet gateway`'s one-line errors for a bad config."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

from gateway.accounts.keys import hash_secret
from gateway.accounts.store.base import Reservation, ReserveRequest, Settlement, UsageRecord
from gateway.accounts.store.sqlite import SqliteStore


def duet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duet", *args], capture_output=True, text=True, timeout=60
    )


def test_teams_keys_usage_report(tmp_path: Path) -> None:
    store = f"sqlite://{tmp_path / 'g.db'}"
    r = duet("teams", "create", "ml", "--tpm", "1000", "--daily-budget", "5", "--store", store)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tpm"] == 1000
    assert (
        duet("teams", "create", "ml", "--store", store).returncode == 2
    )  # exists: one line, exit 2
    r = duet("keys", "create", "--team", "ml", "--name", "ci", "--store", store)
    assert r.returncode == 0, r.stderr
    secret = r.stdout.strip()
    assert secret.startswith("sk-duet-") and len(secret) >= 8 + 43 and "shown only now" in r.stderr
    r = duet("keys", "create", "--team", "nobody", "--store", store)
    assert r.returncode == 2 and "nobody" in r.stderr and "Traceback" not in r.stderr
    listed = json.loads(duet("keys", "list", "--store", store).stdout)
    assert len(listed) == 1 and secret not in json.dumps(listed) and listed[0]["team_id"] == "ml"

    async def settle() -> None:
        s = SqliteStore(tmp_path / "g.db")
        await s.open()
        found = await s.key_by_hash(hash_secret(secret))
        assert found is not None
        for rid, user, cost in (("req-1", "u-1", 0.004), ("req-2", None, 0.002)):
            res = await s.reserve(
                ReserveRequest(
                    team_id="ml",
                    key_id=found[0].id,
                    request_id=rid,
                    tokens=10,
                    cost_usd=0.01,
                    ttl_s=60,
                )
            )
            assert isinstance(res, Reservation)
            await s.settle(
                [
                    Settlement(
                        res.id,
                        UsageRecord(
                            request_id=rid,
                            team_id="ml",
                            key_id=found[0].id,
                            model_requested="m",
                            model_used="m",
                            tier="batch",
                            status="ok",
                            prompt_tokens=6,
                            completion_tokens=3,
                            cost_usd=cost,
                            user=user,
                        ),
                    )
                ]
            )
        await s.close()

    asyncio.run(settle())
    rows = list(csv.DictReader(io.StringIO(duet("usage", "report", "--store", store).stdout)))
    assert [
        (r["request_id"], r["status"], r["prompt_tokens"], r["tier"], r["user"]) for r in rows
    ] == [("req-1", "ok", "6", "batch", "u-1"), ("req-2", "ok", "6", "batch", "")]
    recs = json.loads(duet("usage", "report", "--store", store, "--format", "json").stdout)
    assert [r["user"] for r in recs] == ["u-1", None]
    totals = json.loads(
        duet("usage", "report", "--store", store, "--group-by", "model", "--format", "json").stdout
    )
    assert totals == [
        {
            "model": "m",
            "requests": 2,
            "prompt_tokens": 12,
            "completion_tokens": 6,
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "total_tokens": 18,
            "cost_usd": 0.006,
            "ttft_p50_s": None,
            "ttft_p90_s": None,
        }
    ]
    per_user = json.loads(
        duet("usage", "report", "--store", store, "--group-by", "user", "--format", "json").stdout
    )
    none = {"ttft_p50_s": None, "ttft_p90_s": None}  # no request had a first token
    assert per_user == [
        {
            "user": None,
            "requests": 1,
            "prompt_tokens": 6,
            "completion_tokens": 3,
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "total_tokens": 9,
            "cost_usd": 0.002,
            **none,
        },
        {
            "user": "u-1",
            "requests": 1,
            "prompt_tokens": 6,
            "completion_tokens": 3,
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "total_tokens": 9,
            "cost_usd": 0.004,
            **none,
        },
    ]
    rows = list(
        csv.DictReader(
            io.StringIO(duet("usage", "report", "--store", store, "--group-by", "user").stdout)
        )
    )
    assert [(r["user"], r["requests"]) for r in rows] == [("", "1"), ("u-1", "1")]
    assert (
        json.loads(
            duet(
                "usage", "report", "--store", store, "--date", "2001-01-01", "--format", "json"
            ).stdout
        )
        == []
    )
    r = duet("keys", "revoke", listed[0]["id"], "--store", store)
    assert (
        r.returncode == 0
        and duet("keys", "revoke", listed[0]["id"], "--store", store).returncode == 2
    )


def test_gateway_config_errors_are_one_line(tmp_path: Path) -> None:
    r = duet("gateway", "--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[models.m]\nkind = "cluster"\ntokenizer = "x"\ninput_price = 1\n')
    r = duet("gateway", "--config", str(bad))
    assert r.returncode == 2 and "input_price" in r.stderr
    bad.write_text("[server]\nport = 1\n")
    r = duet("gateway", "--config", str(bad))
    assert r.returncode == 2 and "no [models" in r.stderr
    bad.write_text('[models.m]\nkind = "cluster"\ntokenizer = "no-such-model"\n')
    r = duet("gateway", "--config", str(bad))
    assert r.returncode == 2 and "no-such-model" in r.stderr
    bad.write_text('[models.gpt]\nkind = "external"\n')
    r = duet("gateway", "--config", str(bad))
    import importlib.util

    if importlib.util.find_spec("gateway.backends.providers") is None:
        assert r.returncode == 2 and "external" in r.stderr
    assert "--coordinator" in duet("gateway", "--help").stdout
