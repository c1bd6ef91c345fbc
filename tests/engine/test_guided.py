"""Constrained decoding in the engine (engine/guided.py), on SmolLM2.

The whole schema corpus (bench/data/json_schemas.json) runs as one concurrent batch, mixed with
unconstrained requests: every output is JSON valid against its schema (`jsonschema`), and the
unconstrained rows are what they are alone (only guided rows are masked). Then: a max_tokens cut
is "length", a migrated leg's matcher resumes from its streamed tokens (and, under P/D, takes
P's first token after them, checked against the grammar), invalid guides are
RequestErrors naming the fault, compilation happens off the engine thread and is cached in a
bounded LRU.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import RequestError
from engine.guided import GuidedDecoding
from protocol.resume import Resume
from protocol.structured import Guide, GuideKind
from text.guide_check import canonical_schema

pytestmark = pytest.mark.smollm2

CORPUS: dict[str, dict] = json.loads(
    (Path(__file__).resolve().parents[2] / "bench/data/json_schemas.json").read_text()
)
MAX_TOKENS = 128


def schema_guide(schema: dict) -> Guide:
    return Guide(kind=GuideKind.JSON_SCHEMA, spec=canonical_schema(schema))


def ask(llm: LLM, name: str) -> list[int]:
    words = name.replace("_", " ")
    return llm.tokenizer.encode_chat(
        [{"role": "user", "content": f"Give me an example {words} as JSON."}]
    )


@pytest.fixture(scope="module")
def llm(smollm2: Path) -> LLM:
    return LLM(
        str(smollm2),
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=1024,
        max_num_seqs=64,
    )


@pytest.fixture(scope="module")
def corpus_run(llm: LLM) -> tuple[list, list, list]:
    """The corpus (greedy) plus three unconstrained prompts, all in one batch."""
    free = [
        llm.tokenizer.encode_chat([{"role": "user", "content": q}])
        for q in ("What is the capital of France?", "Write a haiku.", "Count to five.")
    ]
    guided = [ask(llm, n) for n in CORPUS]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guide=schema_guide(s))
        for s in CORPUS.values()
    ]
    plain = SamplingParams(max_tokens=24, temperature=0)
    outs = llm.generate(guided + free, params + [plain] * len(free))
    return outs[: len(guided)], outs[len(guided) :], free


def test_every_corpus_schema_gives_valid_json(corpus_run: tuple) -> None:
    outs, _, _ = corpus_run
    assert len(CORPUS) >= 40
    bad = []
    for (name, schema), o in zip(CORPUS.items(), outs, strict=True):
        try:
            jsonschema.validate(json.loads(o.text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            bad.append(f"{name}: {o.text!r} ({o.finish_reason}): {e}")
        else:
            assert o.finish_reason == "stop", name
    assert not bad, "\n".join(bad)


def test_unconstrained_rows_in_the_batch_are_untouched(llm: LLM, corpus_run: tuple) -> None:
    _, free_outs, free = corpus_run
    alone = llm.generate(free, SamplingParams(max_tokens=24, temperature=0))
    assert [o.token_ids for o in free_outs] == [o.token_ids for o in alone]
    assert not any(o.text.startswith("{") for o in alone)  # the mask did not leak into them


def test_sampled_rows_are_valid_too(llm: LLM) -> None:
    names = list(CORPUS)[::6]
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=1.0, seed=i, guide=schema_guide(CORPUS[n])
        )
        for i, n in enumerate(names)
    ]
    for n, o in zip(names, llm.generate([ask(llm, n) for n in names], params), strict=True):
        if (
            o.finish_reason == "stop"
        ):  # a sampled string may run into max_tokens: then it is "length"
            jsonschema.validate(json.loads(o.text), CORPUS[n])
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS


def test_max_tokens_cutting_the_json_is_length(llm: LLM) -> None:
    o = llm.generate(
        [ask(llm, "person")],
        SamplingParams(max_tokens=3, temperature=0, guide=schema_guide(CORPUS["person"])),
    )[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 3
    assert o.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(o.text)


def test_json_object_regex_and_choice(llm: LLM) -> None:
    prompt = ask(llm, "anything")
    obj, rx, choice = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(max_tokens=64, temperature=0, guide=Guide(kind=GuideKind.JSON_OBJECT)),
            SamplingParams(
                max_tokens=16,
                temperature=0,
                guide=Guide(kind=GuideKind.REGEX, spec="[0-9]{3}-[a-z]{2}"),
            ),
            SamplingParams(
                max_tokens=16,
                temperature=0,
                guide=Guide(kind=GuideKind.CHOICE, spec='["red", "blue"]'),
            ),
        ],
    )
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # an open object may run long: still a prefix of one
        assert obj.text.startswith("{")
    assert rx.finish_reason == "stop" and len(rx.text) == 6 and rx.text[3] == "-"
    assert choice.finish_reason == "stop" and choice.text in ("red", "blue")


def test_a_migrated_leg_resumes_the_matcher(llm: LLM) -> None:
    """D resumes from the tokens sampled so far: greedy, the continuation is the rest of the
    uninterrupted output, and the joined text is valid."""
    schema = CORPUS["nested_address"]
    prompt = ask(llm, "nested_address")
    p = dict(max_tokens=MAX_TOKENS, temperature=0, guide=schema_guide(schema))
    whole = llm.generate([prompt], SamplingParams(**p))[0]
    k = 5
    head = whole.token_ids[:k]
    text_chars = len(llm.tokenizer.decode(head))
    resumed = llm.generate(
        [prompt + head], SamplingParams(**p, resume=Resume(output_tokens=k, text_chars=text_chars))
    )[0]
    assert head + resumed.token_ids == whole.token_ids
    jsonschema.validate(json.loads(whole.text[:text_chars] + resumed.text), schema)
    # tokens the grammar never allows cannot be resumed from
    wrong = llm.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(RequestError, match="do not satisfy"):
        llm.engine.add_request(
            "bad-resume",
            prompt + wrong,
            SamplingParams(**p, resume=Resume(output_tokens=len(wrong), text_chars=5)),
        )


def test_a_migrated_pd_leg_takes_ps_first_token(llm: LLM) -> None:
    """A migrated decode leg under P/D: the matcher resumes over the streamed tokens, then takes
    P's token (`first_token`) as the leg's first. Seeded sampling: the leg still draws for that
    row, so its generator goes on as the uninterrupted run's; a token the grammar does not allow
    there (EOS inside an object) is refused."""
    schema = CORPUS["nested_address"]
    prompt = ask(llm, "nested_address")
    p = dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=5, guide=schema_guide(schema))
    whole = llm.generate([prompt], SamplingParams(**p))[0]
    k = 6
    head = whole.token_ids[:k]
    resume = Resume(output_tokens=k, text_chars=len(llm.tokenizer.decode(head)))
    leg = llm.generate(
        [prompt + head], SamplingParams(**p, resume=resume, first_token=whole.token_ids[k])
    )[0]
    assert leg.token_ids == whole.token_ids[k:]
    eos = min(llm.tokenizer.eos_token_ids)
    with pytest.raises(RequestError, match=f"first token {eos} is not allowed"):
        llm.engine.add_request(
            "bad-first", prompt + head, SamplingParams(**p, resume=resume, first_token=eos)
        )


@pytest.mark.parametrize(
    ("guide", "words"),
    [
        (Guide(kind=GuideKind.JSON_SCHEMA, spec='{"type": "foo"}'), "Invalid type"),
        (Guide(kind=GuideKind.REGEX, spec="(ab"), "unclosed group"),
        (Guide(kind=GuideKind.CHOICE, spec="[]"), "list of choices is empty"),
    ],
)
def test_invalid_guides_are_refused_with_the_engines_words(
    llm: LLM, guide: Guide, words: str
) -> None:
    with pytest.raises(RequestError, match=words):
        llm.engine.add_request(f"bad-{guide.kind}", [1, 2, 3], SamplingParams(guide=guide))


def test_compiles_off_the_engine_thread_once(smollm2: Path, llm: LLM) -> None:
    """AsyncEngine compiles on the pool; the engine thread's attach then hits the cache."""

    async def run() -> tuple[int, int, str]:
        eng = AsyncEngine(
            EngineConfig(model=str(smollm2), dtype="float32", max_model_len=512), core=llm.engine
        )
        eng.start()
        try:
            g = schema_guide(
                {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"],
                    "additionalProperties": False,
                }
            )
            before = (llm.engine.guides.compiled, llm.engine.guides.hits)
            text = ""
            async for d in await eng.add_request(
                "async-guided",
                ask(llm, "flag"),
                SamplingParams(max_tokens=16, temperature=0, guide=g),
            ):
                text += d.new_text
            return llm.engine.guides.compiled - before[0], llm.engine.guides.hits - before[1], text
        finally:
            await eng.stop()

    compiled, hits, text = asyncio.run(run())
    assert compiled == 1 and hits >= 1
    assert isinstance(json.loads(text)["ok"], bool)


def test_the_cache_is_a_bounded_lru(smollm2: Path) -> None:
    gd = GuidedDecoding(smollm2 / "tokenizer.json", 49152, frozenset({2}), cache_size=2)
    a, b, c = (Guide(kind=GuideKind.REGEX, spec=s) for s in ("a+", "b+", "c+"))
    gd.compile(a), gd.compile(b), gd.compile(a)  # a is now the most recent
    gd.compile(c)  # evicts b
    assert (gd.compiled, gd.hits) == (3, 1)
    gd.compile(a)
    assert gd.hits == 2
    gd.compile(b)
    assert gd.compiled == 4
    gd.close()
