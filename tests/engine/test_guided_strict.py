"""A missing grammar engine is never a silent unconstrained fallback (protocol/strict.py): under
strict mode (CI=true) the engine refuses to start; elsewhere guided requests are refused."""

import sys
from pathlib import Path

import pytest

from engine.guided import GuidedDecoding, GuideError
from protocol.strict import FallbackRefused
from protocol.structured import Guide, GuideKind


@pytest.fixture
def no_llguidance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` now raises ImportError


def test_strict_mode_refuses_to_start_without_llguidance(no_llguidance: None, monkeypatch: pytest.MonkeyPatch,
                                                         tiny_llama: Path) -> None:  # fmt: skip
    monkeypatch.setenv("CI", "true")
    with pytest.raises(FallbackRefused, match="llguidance"):
        GuidedDecoding(tiny_llama / "tokenizer.json", 512, frozenset({2}))


def test_elsewhere_guided_requests_are_refused(no_llguidance: None, monkeypatch: pytest.MonkeyPatch,
                                               tiny_llama: Path) -> None:  # fmt: skip
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("DUET_STRICT", raising=False)
    gd = GuidedDecoding(tiny_llama / "tokenizer.json", 512, frozenset({2}))
    with pytest.raises(GuideError, match="not available"):
        gd.compile(Guide(kind=GuideKind.JSON_OBJECT))


def test_the_tiny_models_tokenizer_compiles_a_guide(tiny_llama: Path) -> None:
    gd = GuidedDecoding(tiny_llama / "tokenizer.json", 512, frozenset({2}))
    gd.attach("r", Guide(kind=GuideKind.CHOICE, spec='["yes", "no"]'), [])
    import torch

    x, dead = gd.mask(torch.zeros(2, 512), [(1, "r")])
    assert not dead and torch.isinf(x[1]).sum() > 500 - 10 and not torch.isinf(x[0]).any()
    gd.close()
