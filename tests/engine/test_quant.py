"""The quantized engine: greedy output equals transformers running the same dequantized weights
(fp32), token for token, on the tiny models; the on-disk cache is used, and ignored when stale.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from engine.quant import QuantizedWeight, dequantize
from engine.quant_store import cache_path, load_quantized, write_quantized
from engine.weights import load_weights
from tests.engine.oracle import hf_greedy
from tests.engine.test_correctness import prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def dequantized_model(src: Path, scheme: str, out: Path) -> Path:
    """A transformers-loadable copy of `src` whose linear weights are the dequantized `scheme`
    weights the engine computes with (lm_head untied: the embedding itself stays exact)."""
    cfg = ModelConfig.from_dir(src)
    w = load_weights(
        src, cfg, torch.float32, torch.device("cpu"), quantization=scheme, use_cache=False
    )
    state = load_file(str(src / "model.safetensors"))
    hd, nh, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        q, k, v = dequantize(lw.qkv).split([nh * hd, kvh * hd, kvh * hd])
        state |= {
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": dequantize(lw.o),
            p + "mlp.down_proj.weight": dequantize(lw.down),
        }
        gate, up = dequantize(lw.gate_up).chunk(2)
        state |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
    assert isinstance(w.lm_head, QuantizedWeight)
    state["lm_head.weight"] = dequantize(w.lm_head)
    shutil.copytree(src, out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_greedy_matches_transformers_on_dequantized_weights(
    tiny_model: Path, scheme: str, tmp_path: Path
) -> None:
    _greedy_matches(tiny_model, scheme, tmp_path)


def test_int4_groups_of_64_match_transformers(tiny_llama: Path, tmp_path: Path) -> None:
    _greedy_matches(tiny_llama, "int4-g64", tmp_path)


def _greedy_matches(tiny_model: Path, scheme: str, tmp_path: Path) -> None:
    ref_dir = dequantized_model(tiny_model, scheme, tmp_path / "dequantized")
    llm = LLM(
        str(tiny_model),
        dtype="float32",
        quantization=scheme,
        max_num_batched_tokens=64,
        block_size=16,
    )
    lin = llm.engine.runner.model.layers[0].qkv
    assert lin.weight.scheme == ("int8" if scheme == "int8" else "int4")
    ps = prompts(380, [1, 16, 17, 53], seed=21)
    outs = llm.generate(ps, GREEDY)  # batched decode, chunked prefill
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == hf_greedy(ref_dir, p, 24), f"prompt length {len(p)}"
    # the oracle really runs other weights than the source model's
    src = load_file(str(tiny_model / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    deq = load_file(str(ref_dir / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(src, deq) and torch.allclose(src, deq, atol=0.1)


def test_bf16_activations_with_int4_weights(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="bfloat16", quantization="int4")
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16  # KV cache stays in the engine dtype
    ps = prompts(380, [5, 40], seed=3)
    outs = llm.generate(ps, GREEDY)
    alone = [llm.generate([p], GREEDY)[0] for p in ps]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert all(len(o.token_ids) == 24 for o in outs)


def test_cache_is_written_used_and_invalidated(
    tiny_llama: Path, tmp_path: Path, monkeypatch
) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    path = write_quantized(model, "int4")
    assert path == cache_path(model, "int4") and path.is_file()
    cached = load_quantized(model, "int4")
    assert cached is not None and set(cached) >= {
        "lm_head",
        "model.layers.0.qkv",
        "model.layers.1.down",
    }
    ps = prompts(380, [9, 33], seed=4)
    fresh = LLM(str(model), dtype="float32", quantization="int4").generate(ps, GREEDY)

    import engine.weights

    def refuse(*_a, **_k):
        raise AssertionError("quantized again although a valid cache exists")

    monkeypatch.setattr(engine.weights, "quantize", refuse)
    from_cache = LLM(str(model), dtype="float32", quantization="int4").generate(ps, GREEDY)
    assert [o.token_ids for o in from_cache] == [o.token_ids for o in fresh]

    # the source weights change: the cache no longer matches and is ignored
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert load_quantized(model, "int4") is None
    monkeypatch.undo()
    assert (
        LLM(str(model), dtype="float32", quantization="int4").generate(ps, GREEDY)[0].token_ids
        == fresh[0].token_ids
    )


def test_unknown_scheme_is_a_clear_error(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM(str(tiny_llama), dtype="float32", quantization="int3")
