"""Prompt caching's prices and counts: the cache read and write prices in a request's cost and
its reservation, and Anthropic's split of a prompt into read, written and the rest."""

from __future__ import annotations

import pytest

from gateway.accounts.pricing import cost_usd, worst_case_usd
from gateway.accounts.usage import Accounting
from gateway.api.anthropic.convert import usage_of
from gateway.api.chat_answer import TokenCounts
from gateway.config import ModelConfig

M = ModelConfig(
    name="m",
    input_usd_per_mtok=1.0,
    output_usd_per_mtok=2.0,
    cached_input_usd_per_mtok=0.1,
    cache_write_usd_per_mtok=1.25,
)


def test_reads_and_writes_are_billed_at_their_prices() -> None:
    # 1000 prompt tokens: 200 read, 300 written, 500 plain; 10 completion tokens
    assert cost_usd(M, 1000, 10, cached=200, written=300) == pytest.approx(
        (500 * 1.0 + 200 * 0.1 + 300 * 1.25 + 10 * 2.0) / 1e6
    )
    plain = ModelConfig(name="p", input_usd_per_mtok=1.0, output_usd_per_mtok=2.0)
    assert cost_usd(plain, 1000, 10, cached=200, written=300) == cost_usd(plain, 1000, 10)


def test_the_reservation_holds_at_the_dearest_prompt_price() -> None:
    assert worst_case_usd(M, 1000, 10) == pytest.approx((1000 * 1.25 + 10 * 2.0) / 1e6)


def test_a_write_is_the_kept_prefix_not_read_from_the_cache() -> None:
    acc = Accounting(prompt_tokens=100, cached_tokens=32, retained_tokens=80)
    assert acc.cache_write_tokens == 48
    acc.cached_tokens = 96  # read more than the kept prefix: nothing written
    assert acc.cache_write_tokens == 0


def test_anthropic_usage_adds_up_to_the_prompt() -> None:
    u = usage_of(
        TokenCounts(prompt_tokens=100, completion_tokens=5, cached_tokens=32, cache_write_tokens=48)
    )
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (
        20,
        32,
        48,
    )
