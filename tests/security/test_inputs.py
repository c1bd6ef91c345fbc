"""Hostile input to the gateway's public API gets a defined refusal, and the gateway keeps
serving.

- JSON nested 1,000 deep or more: msgspec's decoder raises RecursionError, which escaped every
  handler as a 500 with a traceback in the log; now a 400 `invalid_json`, on the completion
  endpoints and the admin API alike.
- `/v1/usage?date=nan` (or inf, or a time past any calendar): float() took them, and the store
  was asked for a NaN range; now a 400 naming the parameter.
- A NaN, infinite or negative price in the config: NaN passes every comparison, so a budget
  check against a NaN cost admitted everything; now the config is refused at load.

Real parts: the gateway process (its tokenizer is the tiny model's; no node is needed: every
refusal comes before routing).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import ConfigError, parse_config
from tests.gateway.helpers import gateway_proc, http, make_team, tiny_model
from tests.procs import Proc, free_port, running

DEPTHS = (1_000, 100_000)


@pytest.fixture(scope="module")
def gateway(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, str]]:
    tmp = tmp_path_factory.mktemp("inputs")
    gw = gateway_proc(
        tmp, {"tiny": tiny_model(tiny_llama, both=[f"http://127.0.0.1:{free_port()}"])}
    )
    with running(gw):
        yield gw, make_team(gw.url, "hostile")


def _still_serving(gw: Proc) -> None:
    status, _, body = http(gw.url + "/health")
    assert status == 200 and body["status"] == "ok"


@pytest.mark.parametrize("depth", DEPTHS)
def test_deeply_nested_json_is_a_400(gateway: tuple[Proc, str], depth: int) -> None:
    gw, key = gateway
    nested = b"[" * depth + b"]" * depth
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = b'{"model": "tiny", "messages": ' + nested + b"}"
        status, _, err = http(gw.url + path, "POST", raw=body, key=key)
        assert status == 400 and err["error"]["code"] == "invalid_json", (path, status, err)
    status, _, err = http(gw.url + "/admin/teams", "POST", raw=b'{"id": ' + nested + b"}")
    assert status == 400, (status, err)
    _still_serving(gw)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300"])
def test_usage_dates_must_be_times(gateway: tuple[Proc, str], value: str) -> None:
    gw, key = gateway
    for param in ("date", "start"):
        status, _, err = http(f"{gw.url}/v1/usage?{param}={value}", key=key)
        assert status == 400 and err["error"]["param"] == param, (param, value, status, err)
    _still_serving(gw)


@pytest.mark.parametrize("price", [math.nan, math.inf, -1.0])
def test_prices_must_be_finite_and_not_negative(
    tiny_llama: Path, tmp_path: Path, price: float
) -> None:
    for field in ("input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok"):
        model = {**tiny_model(tiny_llama, both=["http://127.0.0.1:9"]), field: price}
        with pytest.raises(ConfigError, match=field):
            parse_config(
                {"store": {"url": f"sqlite://{tmp_path / 'g.db'}"}, "models": {"tiny": model}}
            )


def test_client_words_cannot_forge_log_lines(gateway: tuple[Proc, str]) -> None:
    """A field name, a model name or a path with a line break in it stays on its own log line
    (it was written raw: the name of an unsupported field forged a whole log line)."""
    gw, key = gateway
    forged = "2026-12-01 00:00:00 INFO duet.gateway forged-line"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], f"x\n{forged}": 1}
    status, _, err = http(gw.url + "/v1/chat/completions", "POST", body, key=key)
    assert status == 400 and err["error"]["code"] == "unsupported_field"
    status, _, err = http(
        gw.url + "/v1/chat/completions",
        "POST",
        {"model": f"m\r\n{forged}", "messages": [{"role": "user", "content": "x"}]},
        key=key,
    )
    assert status == 404
    assert not any(line.startswith(forged) for line in gw.log().splitlines()), gw.log()[-2000:]
