"""Price tables: commercial API prices ($/1M tokens) and GPU prices ($/GPU-hour), dated, each
row with its source. Read from data/prices/*.json; the cost comparisons of `duet plan` use
them and print the date and source of every price they use."""

from __future__ import annotations

from pathlib import Path

import msgspec


class CommercialPrice(msgspec.Struct, frozen=True, kw_only=True):
    provider: str
    model: str
    input_per_m: float
    output_per_m: float
    url: str
    as_of: str
    note: str = ""

    def cost(self, input_tokens: float, output_tokens: float) -> float:
        return (input_tokens * self.input_per_m + output_tokens * self.output_per_m) / 1e6


class GpuPrice(msgspec.Struct, frozen=True, kw_only=True):
    provider: str
    gpu: str
    usd_per_gpu_hour: float
    url: str
    as_of: str
    note: str = ""


class PriceTable(msgspec.Struct, frozen=True, kw_only=True):
    as_of: str
    note: str = ""
    commercial: list[CommercialPrice]
    gpus: list[GpuPrice]


def load(path: Path) -> PriceTable:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=PriceTable)
    except FileNotFoundError:
        raise ValueError(f"no price table at {path}") from None
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: not a price table ({e})") from None
