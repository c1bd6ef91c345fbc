"""`LlamaModel.decode_weight_bytes`: the bytes one single-stream decode step reads, which
bench.engine_tiers divides the machine's read bandwidth by for W2's roofline. Counted from the
model's shape and each scheme's storage (bf16 2 bytes a weight; int8 1 byte plus an fp32 scale
per row; int4 half a byte plus an fp16 scale and min per group, its lm_head int8), so a layer
left out, or a scheme's bytes miscounted, fails here."""

from pathlib import Path

from bench.flops import ModelShape
from engine.config import EngineConfig
from engine.core import EngineCore


def _model(tiny_llama: Path, scheme: str):
    core = EngineCore(
        EngineConfig(
            model=str(tiny_llama),
            dtype="bfloat16",
            device="cpu",
            threads=1,
            quantization=None if scheme == "none" else scheme,
        )
    )
    return core.runner.model, ModelShape.of(core.model_config)


def _linears(s: ModelShape) -> list[tuple[int, int]]:
    """(out, in) of every linear a decode step runs, the lm_head last."""
    q_kv = (s.heads + 2 * s.kv_heads) * s.head_dim
    layer = [
        (q_kv, s.hidden),
        (s.hidden, s.heads * s.head_dim),
        (2 * s.intermediate, s.hidden),
        (s.hidden, s.intermediate),
    ]
    return layer * s.layers + [(s.vocab, s.hidden)]


def _norms_and_row(model) -> int:
    norms = [model.norm, *(t for L in model.layers for t in (L.input_norm, L.post_norm))]
    return sum(t.nbytes for t in norms) + model.embed.shape[1] * model.embed.element_size()


def test_bf16_int8_and_int4_bytes_follow_their_storage(tiny_llama: Path) -> None:
    per_scheme = {
        "none": lambda n, k, head: 2 * n * k,
        "int8": lambda n, k, head: n * k + 4 * n,
        # int4 groups of 32 (engine/quant.py's default) with fp16 d and m; the lm_head stays int8
        "int4": lambda n, k, head: n * k + 4 * n if head else n * k // 2 + 2 * 2 * n * (k // 32),
    }
    got = {}
    for scheme, cost in per_scheme.items():
        model, shape = _model(tiny_llama, scheme)
        mats = _linears(shape)
        want = sum(
            cost(n, k, i == len(mats) - 1) for i, (n, k) in enumerate(mats)
        ) + _norms_and_row(model)
        got[scheme] = model.decode_weight_bytes()
        assert got[scheme] == want, scheme
    assert got["int4"] < got["int8"] < got["none"]


def test_w8a8_counts_its_packed_int8_weights(tiny_llama: Path) -> None:
    """One-row W8A8 calls read the blocked int8 packing (padded to its tiles, plus per-row
    sums), not the weight-only matrix: at least int8's bytes, within its padding."""
    int8, _ = _model(tiny_llama, "int8")
    w8a8, _ = _model(tiny_llama, "int8-w8a8")
    assert (
        int8.decode_weight_bytes() <= w8a8.decode_weight_bytes() <= 1.5 * int8.decode_weight_bytes()
    )


def test_read_bandwidth_is_a_positive_rate() -> None:
    from bench.flops import read_bandwidth_gbps

    assert 0.1 < read_bandwidth_gbps(mib=64, repeats=2) < 10_000
