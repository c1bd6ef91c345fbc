"""What a request costs: per-million-token prices from gateway.toml."""

from __future__ import annotations

from gateway.config import ModelConfig


def cost_usd(m: ModelConfig, prompt: int, completion: int, cached: int = 0) -> float:
    cached = min(max(cached, 0), prompt)
    cached_price = (
        m.input_usd_per_mtok if m.cached_input_usd_per_mtok is None else m.cached_input_usd_per_mtok
    )
    return (
        (prompt - cached) * m.input_usd_per_mtok
        + cached * cached_price
        + completion * m.output_usd_per_mtok
    ) / 1e6


def worst_case_usd(m: ModelConfig, prompt: int, max_completion: int) -> float:
    """The reservation: no cache hit, every sample runs to max_tokens."""
    cached_price = m.cached_input_usd_per_mtok or 0.0
    return (
        cost_usd(m, prompt, max_completion)
        if cached_price <= m.input_usd_per_mtok
        else (prompt * cached_price + max_completion * m.output_usd_per_mtok) / 1e6
    )
