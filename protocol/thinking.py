"""Anthropic's `thinking` request field as the gateway carries it from `/v1/messages` through the
chat path to an Anthropic provider's model that reasons (gateway/backends/providers/translate.py
writes it back into the provider's request unchanged). `enabled` needs `budget_tokens` (the
API's minimum is 1024, below `max_tokens`: the provider checks it, with its own words);
`adaptive` (the newer models' mode) has none; `disabled` is no thinking and is never carried.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class Thinking(
    msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True, forbid_unknown_fields=True
):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None

    @property
    def on(self) -> bool:
        """It asks for reasoning (anything but `disabled`)."""
        return self.type != "disabled"
