"""A chat answer's reasoning, gathered from its pieces for the whole answer: its text
(`reasoning_content`) and its blocks (`thinking_blocks`, protocol/chat.py `ThinkingBlock`).

Pieces of a block join as a stream sends them: a `thinking` piece's text continues the last
block while that block has no signature yet (the signature is a block's last piece), else it
opens a new block; a signature piece closes the last block; a redacted block comes whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from msgspec.structs import replace

from gateway.backends.base import Piece
from protocol.chat import ChatMessageOut, ReasonedMessage, ThinkingBlock


def join_blocks(blocks: list[ThinkingBlock], pieces: list[ThinkingBlock]) -> None:
    """`pieces` added to `blocks` (whole blocks, or a stream's pieces of them), in place."""
    for b in pieces:
        last = blocks[-1] if blocks else None
        open_ = last is not None and last.type == "thinking" and last.signature is None
        if b.type == "thinking" and open_ and last is not None:
            blocks[-1] = replace(
                last,
                thinking=(last.thinking or "") + (b.thinking or ""),
                signature=b.signature,
            )
        else:
            blocks.append(b)


@dataclass
class Reasoning:
    """Each choice's reasoning so far (choice index → its text pieces and blocks)."""

    texts: dict[int, list[str]] = field(default_factory=dict)
    blocks: dict[int, list[ThinkingBlock]] = field(default_factory=dict)

    def add(self, p: Piece) -> None:
        if p.reasoning:
            self.texts.setdefault(p.index, []).append(p.reasoning)
        if p.thinking:
            join_blocks(self.blocks.setdefault(p.index, []), p.thinking)

    def message(self, index: int, m: ChatMessageOut) -> ChatMessageOut:
        """Choice `index`'s message `m`, with its reasoning if it has any."""
        text, blocks = "".join(self.texts.get(index, ())), self.blocks.get(index)
        if not text and not blocks:
            return m
        return ReasonedMessage(
            **msgspec.structs.asdict(m), reasoning_content=text or None, thinking_blocks=blocks
        )
