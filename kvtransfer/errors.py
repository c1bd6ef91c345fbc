"""The exceptions every transport raises, whatever its backend.

Callers (the decode node) branch on the class, never on a backend's own exception: a
`TransferError` means "these blocks did not arrive, recompute or fail the request".
Validation errors (`LayoutMismatch`, `BlockRangeError`) are raised before any byte moves;
`TransferTimeout` and `PeerError` can come mid-transfer, after which the content of the
destination blocks is undefined.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any


class TransferError(Exception):
    """A KV transfer (or its setup) failed; the destination blocks hold no usable data."""

    #: a failed read whose backend may still write the local blocks: completes when it no
    #: longer can (the blocks stay set aside until then); None when nothing is left in flight
    settled: Awaitable[Any] | None = None


class TransferTimeout(TransferError, TimeoutError):
    """The transfer did not complete within its timeout."""


class PeerError(TransferError):
    """The peer is unknown, unreachable, dead, or answered with an error."""


class LayoutMismatch(TransferError):
    """The peer's KV layout is not compatible with this node's; nothing was transferred."""

    def __init__(self, engine_id: str, differences: list[str]) -> None:
        self.engine_id = engine_id
        self.differences = list(differences)
        super().__init__(
            f"KV layout of peer {engine_id!r} is incompatible with this node's: "
            + "; ".join(self.differences)
        )


class BlockRangeError(TransferError, ValueError):
    """Block ids are out of range, of unequal length, or repeat a destination block."""


class BackendUnavailable(TransferError):
    """The requested backend cannot run here (library missing, unsupported device)."""
