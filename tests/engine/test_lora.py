"""Multi-LoRA in the engine against transformers + PEFT (fp32, tiny random adapters): eight
adapters of different ranks, targets and scalings and the base model in one batch give, per
request, exactly PEFT's tokens with that adapter; an adapter's KV is cached under its own root;
slots are reused least-recently-used first and never taken from an adapter in use; what the
engine does not apply is refused with the reason."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.lora import LoraError, LoraSlotsFull
from tests.engine.oracle import hf_greedy
from tests.fixtures.tiny_archs import make_tiny_arch
from tests.fixtures.tiny_lora import make_adapter, peft_greedy

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: eight adapters that differ in rank, targets, alpha, rsLoRA and the layers they adapt
SHAPES = [
    dict(r=8, lora_alpha=16, target_modules=ALL),
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    dict(r=2, lora_alpha=2, target_modules=["o_proj", "down_proj"]),
    dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj"], use_rslora=True),
    dict(r=6, lora_alpha=12, target_modules=["k_proj", "down_proj"], layers_to_transform=[1]),
    dict(r=1, lora_alpha=3, target_modules=ALL),
    dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    dict(r=3, lora_alpha=6, target_modules=["up_proj", "down_proj", "q_proj"]),
]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("loras")
    return [make_adapter(tiny_llama, root / f"a{i}", i, **s) for i, s in enumerate(SHAPES)]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def test_eight_adapters_and_the_base_in_one_batch_match_peft(
    tiny_llama: Path, adapters: list[Path]
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_loras=8, max_lora_rank=8, threads=1)
    reqs = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)] + [None]
    ps = _prompts(len(reqs), seed=1)
    outs = llm.generate(ps, GREEDY, lora_request=reqs)
    assert llm.engine.counters.steps < 20, "the nine requests should have shared steps"
    base = [hf_greedy(tiny_llama, p, 10) for p in ps]
    for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
        want = base[i] if reqs[i] is None else peft_greedy(tiny_llama, adapters[i], p, 10)
        assert o.token_ids == want, f"request {i} ({'base' if reqs[i] is None else SHAPES[i]})"
    moved = sum(o.token_ids != b for o, b in zip(outs[:-1], base, strict=False))
    assert moved >= 6, f"only {moved} of 8 adapters changed the base model's tokens"


def test_kv_is_cached_per_adapter(tiny_llama: Path, adapters: list[Path]) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_loras=2, max_lora_rank=8, threads=1)
    a0, a1 = (LoRARequest(f"a{i}", i + 1, str(adapters[i])) for i in (0, 1))
    prompt = _prompts(1, seed=2)[0][:1] * 40
    first = llm.generate([prompt], GREEDY, lora_request=a0)[0]
    assert first.num_cached_tokens == 0
    other = llm.generate([prompt], GREEDY, lora_request=a1)[0]
    assert other.num_cached_tokens == 0, "another adapter's KV must not serve this one"
    base = llm.generate([prompt], GREEDY)[0]
    assert base.num_cached_tokens == 0, "an adapter's KV must not serve the base model"
    again = llm.generate([prompt], GREEDY, lora_request=a0)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == first.token_ids
    assert again.token_ids == peft_greedy(tiny_llama, adapters[0], prompt, 10)


def test_slots_are_reused_lru_and_never_from_an_adapter_in_use(
    tiny_llama: Path, adapters: list[Path]
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_loras=2, max_lora_rank=8, threads=1)
    req = [LoRARequest(f"a{i}", i + 1, str(adapters[i])) for i in range(3)]
    llm.load_lora(req[0])
    llm.load_lora(req[1])
    llm.generate([[5, 6]], GREEDY, lora_request=req[0])  # a0 used last: a1 is the LRU
    assert llm.load_lora(req[2]) == ["a1"]
    assert llm.engine.lora_names() == ["a0", "a2"]
    core = llm.engine
    core.add_request("busy-0", [5, 6, 7], SamplingParams(max_tokens=2, lora_name="a0"))
    core.add_request("busy-2", [5, 6, 7], SamplingParams(max_tokens=2, lora_name="a2"))
    with pytest.raises(LoraSlotsFull, match="running requests use"):
        llm.load_lora(req[1])
    with pytest.raises(LoraError, match="in use by 1 request"):
        core.unload_lora("a0")
    while core.has_unfinished():
        core.step()
    assert core.unload_lora("a0") and core.lora_names() == ["a2"]
    out = llm.generate([[5, 6]], GREEDY, lora_request=req[1])[0]  # a free slot again
    assert out.token_ids == peft_greedy(tiny_llama, adapters[1], [5, 6], 10)


@pytest.mark.parametrize(
    ("lora", "reason"),
    [
        (dict(r=4, target_modules=["q_proj"], use_dora=True), "use_dora"),
        (dict(r=4, target_modules=["lm_head"]), "lm_head"),
        (dict(r=16, target_modules=["q_proj"]), "rank 16 exceeds"),
        (dict(r=4, target_modules=["q_proj"], lora_dropout=0.1, bias="all"), "bias"),
    ],
)
def test_adapters_the_engine_cannot_apply_are_refused(
    tiny_llama: Path, tmp_path: Path, lora: dict, reason: str
) -> None:
    path = make_adapter(tiny_llama, tmp_path / "bad", 0, **lora)
    llm = LLM(str(tiny_llama), dtype="float32", max_loras=1, max_lora_rank=8, threads=1)
    with pytest.raises(LoraError, match=reason):
        llm.load_lora(LoRARequest("bad", 1, str(path)))
    with pytest.raises(ValueError, match="not loaded"):
        llm.generate([[5]], SamplingParams(lora_name="bad"))


@pytest.mark.parametrize(
    ("arch", "targets"),
    [("gemma2", ALL), ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])],
)
def test_adapters_on_other_architectures_match_peft(
    tmp_path_factory: pytest.TempPathFactory, arch: str, targets: list[str]
) -> None:
    base = make_tiny_arch(tmp_path_factory.mktemp(arch), arch)
    path = make_adapter(
        base,
        tmp_path_factory.mktemp(f"{arch}-lora") / "a",
        7,
        r=4,
        lora_alpha=8,
        target_modules=targets,
    )
    llm = LLM(str(base), dtype="float32", max_loras=1, max_lora_rank=8, threads=1)
    ps = _prompts(3, seed=5)
    outs = llm.generate(ps, GREEDY, lora_request=LoRARequest("x", 1, str(path)))
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == peft_greedy(base, path, p, 10)
