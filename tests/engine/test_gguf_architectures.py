"""GGUF files of architectures past the Llama family (Phi-3, Gemma 2, Gemma 3), written as
llama.cpp's converter writes them (tests/fixtures/gguf_writer.py): engine/convert.py turns each into
a model directory through transformers, and the engine runs it token-identically to transformers on
the same directory."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.convert import convert_gguf
from tests.engine.oracle import hf_greedy
from tests.fixtures.gguf_writer import write_gguf
from tests.fixtures.tiny_archs import make_tiny_arch

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3"])
def test_a_converted_gguf_runs_like_transformers(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    src = make_tiny_arch(tmp_path_factory.mktemp(arch), arch)
    tmp = tmp_path_factory.mktemp(f"{arch}-gguf")
    gguf_file = write_gguf(src, tmp / f"{arch}.gguf")
    converted = convert_gguf(gguf_file, tmp / "converted")
    model_type = json.loads((converted / "config.json").read_text())["model_type"]
    assert model_type == {"gemma3": "gemma3_text"}.get(arch, arch)
    llm = LLM(str(converted), dtype="float32", num_kv_blocks=64, max_model_len=512, threads=1)
    prompts = [list(range(3, 3 + n)) for n in (5, 30)]
    for p, o in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(converted, p, 8)
