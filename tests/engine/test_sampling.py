"""Sampling, stop conditions and finish reasons."""

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


PROMPT = [11, 22, 33, 44, 55]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    p = SamplingParams(
        max_tokens=30, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    a = llm.generate([PROMPT], p)[0]
    others = [SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)] * 5
    b = llm.generate([[7, 8, 9]] * 5 + [PROMPT], [*others, p])[-1]
    assert a.token_ids == b.token_ids
    c = llm.generate(
        [PROMPT], SamplingParams(max_tokens=30, temperature=1.0, seed=99, ignore_eos=True)
    )[0]
    assert c.token_ids != a.token_ids  # a different seed draws differently


def test_top_k_1_is_greedy(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
        0
    ]
    topk = llm.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=5.0, top_k=1, ignore_eos=True)
    )[0]
    assert greedy.token_ids == topk.token_ids


def test_stop_string_cuts_text_exactly(llm: LLM) -> None:
    full = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    text = full.text
    assert len(text) > 10
    stop = text[6:9]  # somewhere inside the output, possibly spanning tokens
    cut = llm.generate(
        [PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert len(cut.token_ids) < len(full.token_ids)


def test_stop_token_ids_and_eos_and_length(llm: LLM) -> None:
    full = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    tok = full.token_ids[5]
    first = full.token_ids.index(tok)
    o = llm.generate(
        [PROMPT],
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[tok]),
    )[0]
    assert o.token_ids == full.token_ids[: first + 1]
    assert (o.finish_reason, o.stop_reason) == ("stop", tok)
    assert full.finish_reason == "length" and len(full.token_ids) == 20


def test_eos_stops_unless_ignored_or_before_min_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    """The random model never picks its EOS (id 2) greedily here, so give a copy of it an EOS it
    does pick: the 5th greedy token (config.json and generation_config.json). Its tokenizer's
    EOS stays, so the engine stops on either."""
    model = shutil.copytree(tiny_llama, tmp_path / "tiny-eos")
    base = LLM(str(model), dtype="float32")
    full = base.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[
        0
    ].token_ids
    assert 2 not in full  # else the copy would not be needed; the cut below assumes it
    eos = full[4]
    first = full.index(eos)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model / name).read_text())
        cfg["eos_token_id"] = eos
        (model / name).write_text(json.dumps(cfg))
    llm = LLM(str(model), dtype="float32")
    assert eos in llm.tokenizer.eos_token_ids
    o = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0))[0]
    assert o.token_ids == full[: first + 1]  # EOS is kept as the last token, as in vLLM
    assert (o.finish_reason, o.stop_reason) == ("stop", None)
    ignored = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[
        0
    ]
    assert ignored.token_ids == full and ignored.finish_reason == "length"
    # min_tokens masks EOS until it is reached: the output is at least that long.
    late = llm.generate(
        [PROMPT], SamplingParams(max_tokens=20, temperature=0, min_tokens=first + 2)
    )[0]
    assert len(late.token_ids) >= first + 2 and eos not in late.token_ids[: first + 1]


def test_min_tokens_suppresses_stop(llm: LLM) -> None:
    full = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    tok = full.token_ids[0]
    o = llm.generate(
        [PROMPT],
        SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[tok], min_tokens=3
        ),
    )[0]
    assert len(o.token_ids) >= 3


def test_text_equals_decoding_the_tokens(llm: LLM) -> None:
    for o in llm.generate(
        [PROMPT, [5], list(range(3, 60))], SamplingParams(max_tokens=25, temperature=0.7, seed=3)
    ):
        assert o.text == llm.tokenizer.decode(o.token_ids)
        assert "\ufffd" not in o.text or "\ufffd" in llm.tokenizer.decode(o.token_ids)


def test_invalid_params() -> None:
    for bad in (
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -5},
        {"stop": [""]},
        {"max_tokens": -3},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
