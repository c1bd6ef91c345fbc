"""A chat answer's reasoning blocks gathered from stream pieces (gateway/serving/reasoning.py):
a block's text pieces join until its signature closes it, the next text opens a new block, a
redacted block stays whole, and whole blocks pass as they are."""

from __future__ import annotations

from gateway.serving.reasoning import join_blocks
from protocol.chat import ThinkingBlock


def _t(thinking: str | None = None, signature: str | None = None) -> ThinkingBlock:
    return ThinkingBlock(type="thinking", thinking=thinking, signature=signature)


def test_pieces_join_into_the_blocks_a_stream_sent() -> None:
    redacted = ThinkingBlock(type="redacted_thinking", data="enc")
    blocks: list[ThinkingBlock] = []
    for piece in [_t("let "), _t("me see"), _t(signature="s1"), redacted, _t("again")]:
        join_blocks(blocks, [piece])
    join_blocks(blocks, [_t(signature="s2")])
    assert blocks == [_t("let me see", "s1"), redacted, _t("again", "s2")]


def test_whole_blocks_stay_as_they_are() -> None:
    whole = [_t("a", "s1"), _t("b", "s2")]
    blocks: list[ThinkingBlock] = []
    join_blocks(blocks, whole)
    assert blocks == whole
