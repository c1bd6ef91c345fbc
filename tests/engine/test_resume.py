"""A migrated request's engine state (protocol/resume.py): `TextState.resumed` continues the
text exactly where the client's stops — through split UTF-8 characters, leading spaces and stop
strings held back across the seam — and a seeded `Sampler` continues its random sequence after
skipping the streamed tokens' draws."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.outputs import TextState
from engine.sampler import Sampler
from protocol.resume import Resume
from protocol.sampling import SamplingParams
from text.tokenizer import Tokenizer

TEXT = (
    " héllo wörld, 日本語のテキスト 🙂🙂 and STOP-ish words: "
    "a stop string STOP here, more text after"
)


def _run(state: TextState, ids: list[int]) -> tuple[list[str], str | None]:
    """Every delta of `ids` fed one by one (the last ends the sequence), until a stop matches."""
    deltas = []
    for i, t in enumerate(ids):
        delta, matched = state.add(t, last=i == len(ids) - 1)
        deltas.append(delta)
        if matched is not None:
            return deltas, matched
    return deltas, None


@pytest.mark.parametrize("stop", [[], ["STOP here"]], ids=["no-stop", "stop-across-the-seam"])
def test_resumed_text_continues_exactly(tiny_llama: Path, stop: list[str]) -> None:
    tok = Tokenizer(tiny_llama)
    prompt = tok.encode("The prompt:")
    out = tok.encode(TEXT)
    whole, matched = _run(TextState(tok, prompt, stop, True), out)
    assert (matched is not None) == bool(stop)
    want = "".join(whole)
    assert "\ufffd" not in want
    held = 0
    for k in range(1, len(whole)):  # the first node streamed k tokens and `sent` characters
        sent = "".join(whole[:k])
        held += whole[k - 1] == ""
        state = TextState.resumed(
            tok, prompt + out[:k], stop, True, Resume(output_tokens=k, text_chars=len(sent))
        )
        rest, _ = _run(state, out[k : len(whole)])
        assert sent + "".join(rest) == want, k
    assert held, "the text holds nothing back at any seam: the test proves less than it says"


def test_seeded_sampler_continues_after_the_skip() -> None:
    torch.manual_seed(0)
    logits = torch.randn(12, 50)
    params = SamplingParams(temperature=0.9, seed=99, max_tokens=12)
    first = Sampler()
    want = [first.sample(logits[i : i + 1], [("r", params, True)])[0] for i in range(12)]
    k = 5
    resumed = SamplingParams(
        temperature=0.9, seed=99, max_tokens=7, resume=Resume(output_tokens=k, text_chars=0)
    )
    second = Sampler()
    got = [second.sample(logits[i : i + 1], [("r.m1", resumed, True)])[0] for i in range(k, 12)]
    assert got == want[k:]
    fresh = Sampler()  # without the skip the sequence starts over: the test can fail
    assert [
        fresh.sample(logits[i : i + 1], [("x", params, True)])[0] for i in range(k, 12)
    ] != want[k:]
