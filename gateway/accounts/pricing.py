"""What a request costs: per-million-token prices from gateway.toml."""

from __future__ import annotations

from gateway.config import ModelConfig


def cost_usd(
    m: ModelConfig, prompt: int, completion: int, cached: int = 0, written: int = 0
) -> float:
    """`cached` prompt tokens were read from a prefix cache (the cache read price), `written`
    others were written to the cache the client asked for (its `cache_control`: the cache
    write price); both default to the input price."""
    cached = min(max(cached, 0), prompt)
    written = min(max(written, 0), prompt - cached)
    cached_price = (
        m.input_usd_per_mtok if m.cached_input_usd_per_mtok is None else m.cached_input_usd_per_mtok
    )
    write_price = (
        m.input_usd_per_mtok if m.cache_write_usd_per_mtok is None else m.cache_write_usd_per_mtok
    )
    return (
        (prompt - cached - written) * m.input_usd_per_mtok
        + cached * cached_price
        + written * write_price
        + completion * m.output_usd_per_mtok
    ) / 1e6


def worst_case_usd(m: ModelConfig, prompt: int, max_completion: int) -> float:
    """The reservation: every prompt token at the dearest of the input, cache read and cache
    write prices, every sample running to max_tokens."""
    per_prompt = max(
        m.input_usd_per_mtok, m.cached_input_usd_per_mtok or 0.0, m.cache_write_usd_per_mtok or 0.0
    )
    return (prompt * per_prompt + max_completion * m.output_usd_per_mtok) / 1e6
