"""Sleep mode in the engine: asleep, the weights are gone and the KV pool's pages are back with the
OS (mincore says so); the next request wakes it and gets the same tokens; a LoRA adapter survives
the nap; an engine holding requests refuses to sleep."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.sleep import EngineBusy, resident_bytes
from tests.fixtures.tiny_lora import make_adapter, peft_greedy

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_sleep_releases_and_a_request_wakes(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=512, threads=1)
    core = llm.engine
    prompt = list(range(5, 60))
    before = llm.generate([prompt], GREEDY)[0]
    pool = core.runner.kv_cache
    assert resident_bytes(pool) > pool.nbytes // 2
    report = core.sleep()
    assert core.sleeping and core.runner.model is None
    assert report.kv_bytes_released > pool.nbytes * 0.9 and report.weight_bytes > 0
    assert resident_bytes(pool) < pool.nbytes // 100, "the pool's pages went back to the OS"
    assert core.pool.num_cached == 0, "the prefix cache is cleared with the pool"
    assert core.stats()["sleeping"] == 1.0
    after = llm.generate([prompt], GREEDY)[0]  # wakes it
    assert not core.sleeping and core.wakes == 1 and core.last_wake_s > 0
    assert after.token_ids == before.token_ids and after.num_cached_tokens == 0
    assert core.runner.kv_cache.data_ptr() == pool.data_ptr(), "the pool keeps its address"


def test_an_engine_with_requests_refuses_to_sleep(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", threads=1)
    llm.engine.add_request("r", [5, 6, 7], GREEDY)
    with pytest.raises(EngineBusy, match="1 request"):
        llm.engine.sleep()
    assert not llm.engine.sleeping


def test_adapters_survive_sleep(tiny_llama: Path, tmp_path: Path) -> None:
    path = make_adapter(
        tiny_llama, tmp_path / "a", 3, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]
    )
    llm = LLM(str(tiny_llama), dtype="float32", max_loras=1, max_lora_rank=4, threads=1)
    req = LoRARequest("a", 1, str(path))
    llm.load_lora(req)
    llm.engine.sleep()
    prompt = list(range(9, 40))
    out = llm.generate([prompt], GREEDY, lora_request=req)[0]
    assert out.token_ids == peft_greedy(tiny_llama, path, prompt, 8)
