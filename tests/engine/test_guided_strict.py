"""Guided decoding on the tiny model, no SmolLM2 needed: a missing grammar engine is never a silent
unconstrained fallback (runtime/strict.py: under CI=true the engine refuses to start; elsewhere
guided requests are refused); only guided rows are masked; speculation is off for guided and
penalised requests."""

import sys
from pathlib import Path

import pytest

from engine.guided import GuidedDecoding, GuideError
from protocol.structured import Guide, GuideKind
from runtime.strict import FallbackRefused


@pytest.fixture
def no_llguidance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        sys.modules, "llguidance", None
    )  # `import llguidance` now raises ImportError


def test_strict_mode_refuses_to_start_without_llguidance(
    no_llguidance: None, monkeypatch: pytest.MonkeyPatch, tiny_llama: Path
) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(FallbackRefused, match="llguidance"):
        GuidedDecoding(tiny_llama / "tokenizer.json", 512, frozenset({2}))


def test_elsewhere_guided_requests_are_refused(
    no_llguidance: None, monkeypatch: pytest.MonkeyPatch, tiny_llama: Path
) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("DUET_STRICT", raising=False)
    gd = GuidedDecoding(tiny_llama / "tokenizer.json", 512, frozenset({2}))
    with pytest.raises(GuideError, match="not available"):
        gd.compile(Guide(kind=GuideKind.JSON_OBJECT))


def test_only_the_guided_rows_are_masked(tiny_llama: Path) -> None:
    import torch

    gd = GuidedDecoding(tiny_llama / "tokenizer.json", 512, frozenset({2}))
    gd.attach("a", Guide(kind=GuideKind.CHOICE, spec='["yes", "no"]'), [])
    gd.attach("b", Guide(kind=GuideKind.REGEX, spec="[0-9]+"), [])
    logits = torch.zeros(3, 512)
    for rows in ([(1, "a")], [(0, "a"), (2, "b")], [(0, "a"), (1, "b")]):  # one, apart, contiguous
        x, dead = gd.mask(logits, rows)
        assert not dead and not torch.isinf(logits).any()  # a copy: the step's logits stay raw
        for r in range(3):
            masked = int(torch.isinf(x[r]).sum())
            assert (masked > 400) if r in dict(rows) else masked == 0
    gd.close()


def test_speculation_is_off_for_guided_and_penalised_requests(tiny_llama: Path) -> None:
    """The verifier scores a draft's positions in one pass; masks and penalties depend on the
    tokens before each position, so such requests get no drafts (and stay exact)."""
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_llama), dtype="float32", speculative="ngram", num_speculative_tokens=4)
    prompt = [
        11,
        22,
        33,
        44,
        55,
    ]  # greedy, the tiny model repeats itself here: n-grams to draft from
    guided, penalised = llm.generate(
        [prompt] * 2,
        [
            SamplingParams(
                max_tokens=8, temperature=0, guide=Guide(kind=GuideKind.REGEX, spec="[a-z]{8}")
            ),
            SamplingParams(max_tokens=80, temperature=0, ignore_eos=True, frequency_penalty=0.5),
        ],
    )
    assert llm.engine.stats()["spec_decode_num_drafts"] == 0
    assert len(guided.text) == 8 and guided.text.isalpha() and guided.text.islower()
    assert len(penalised.token_ids) == 80
    plain = llm.generate([prompt], SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))[0]
    assert (
        plain.token_ids and llm.engine.stats()["spec_decode_num_drafts"] > 0
    )  # the engine does speculate
