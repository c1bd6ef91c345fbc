"""W8A8: the int8 GEMM kernels against `w8a8_reference`, bit for bit — integer sums are
exact, so the AMX, VNNI and portable paths, the decode and batched calls, and torch all agree —
activation groups (one scale per group of inputs: int8-w8a8's down) included — and the engine's
greedy output under int8-w8a8 / int4-w4a8 equals the same model computed with the torch reference
arithmetic (DUET_DISABLE_KERNELS), token for token."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine.kernels
from engine.kernels import kernels_lib
from engine.qlinear import QLinear
from engine.quant import int8_for_gemm, pack_w8a8, quantize, w8a8_reference
from tests.engine.isa import skip_unless_runs_here

lib = kernels_lib()
needs_kernels = pytest.mark.skipif(
    lib is None, reason="kernels unavailable (no C compiler, or DUET_DISABLE_KERNELS)"
)

SHAPES = [(960, 576), (576, 1536), (37, 100), (3072, 576)]


@needs_kernels
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_equals_reference_bitwise(n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n + k)
    qw = quantize(torch.randn(n, k, generator=g) * 0.05, "int8")
    bias = torch.randn(n, generator=g).to(dtype)
    lin = QLinear(qw, bias, act_int8=True)
    # VNNI below 16 rows, AMX (where granted) from 16; 400 x 3072 bf16 outputs pass L2's size, where
    # the AMX epilogue stores non-temporally
    for m in (1, 2, 5, 16, 33, 100, 400):
        x = (torch.randn(m, k, generator=g) * 3).to(dtype)
        x[0, 0] = 40.0  # an outlier sets its row's scale
        got = lin(x)
        assert torch.equal(got, w8a8_reference(x, qw, bias)), f"m={m}"
        for r in (0, m - 1):  # a row's result does not depend on the batch
            assert torch.equal(lin(x[r : r + 1]), got[r : r + 1])


@needs_kernels
@pytest.mark.parametrize(
    ("n", "k", "group"),
    [
        (576, 1536, 128),
        (960, 576, 128),
        (70, 200, 128),
        (37, 100, 64),
        (96, 256, 256),
        (96, 256, 512),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_grouped_activation_scales_equal_the_reference_bitwise(
    n: int, k: int, group: int, dtype: torch.dtype
) -> None:
    """One activation scale per `group` inputs: each group's sums dequantized on their own and
    added in fp32 in group order, on every path (GEMV, VNNI batches, AMX from 16 rows), a partial
    last group included; a group of the whole row is the ungrouped arithmetic bit for bit."""
    g = torch.Generator().manual_seed(n * k + group)
    qw = quantize(torch.randn(n, k, generator=g) * 0.05, "int8")
    lin = QLinear(qw, None, act_int8=True, act_group=group)
    plain = QLinear(qw, None, act_int8=True)
    bias = torch.randn(n, generator=g).to(dtype)
    biased = QLinear(qw, bias, act_int8=True, act_group=group)  # the last group's dequant adds it
    for m in (1, 2, 7, 16, 40, 130):
        x = (torch.randn(m, k, generator=g) * 3).to(dtype)
        x[:, min(k - 1, 70)] = 60.0  # an outlier in one group: the others keep their resolution
        got = lin(x)
        assert torch.equal(got, w8a8_reference(x, qw, group=group)), f"m={m}"
        assert torch.equal(biased(x), w8a8_reference(x, qw, bias, group=group)), f"m={m} biased"
        if group >= k:
            assert torch.equal(got, plain(x)) and torch.equal(got, w8a8_reference(x, qw))
        else:
            # the groups away from the outlier are quantized finer: closer to full precision
            exact = x.float() @ (qw.q.float() * qw.scales[:, None]).T
            assert (got.float() - exact).abs().mean() < (plain(x).float() - exact).abs().mean()
        for r in (0, m - 1):
            assert torch.equal(lin(x[r : r + 1]), got[r : r + 1])
        assert torch.equal(
            lin(x, torch.float32), w8a8_reference(x, qw, out_dtype=torch.float32, group=group)
        )


def test_an_activation_group_is_a_multiple_of_64() -> None:
    qw = quantize(torch.randn(32, 256), "int8")
    with pytest.raises(ValueError, match="multiple of 64"):
        QLinear(qw, act_int8=True, act_group=100)
    if lib is not None:  # the kernel refuses one too, whatever the caller
        packed, wsum = pack_w8a8(qw.q)
        x, out = torch.randn(2, 256), torch.empty(2, 32)
        assert (
            lib.qlinear_w8a8(
                x.data_ptr(),
                256,
                2,
                256,
                packed.data_ptr(),
                qw.scales.data_ptr(),
                wsum.data_ptr(),
                32,
                None,
                out.data_ptr(),
                32,
                0,
                0,
                96,
            )
            == -2
        )


@needs_kernels
def test_int4_w4a8_uses_requantized_int8_for_batches_and_int4_for_one_row() -> None:
    g = torch.Generator().manual_seed(3)
    qw = quantize(torch.randn(96, 128, generator=g), "int4")
    lin = QLinear(qw, act_int8=True)
    x = torch.randn(4, 128, generator=g).bfloat16()
    assert torch.equal(lin(x), w8a8_reference(x, int8_for_gemm(qw)))
    assert torch.equal(lin(x[:1]), QLinear(qw)(x[:1]))  # weight-only int4 GEMV


def test_zero_rows_and_fp32_logits_out() -> None:
    qw = quantize(torch.randn(40, 64), "int8")
    lin = QLinear(qw, act_int8=True)
    x = torch.zeros(3, 64).bfloat16()
    assert torch.equal(lin(x), torch.zeros(3, 40).bfloat16())
    x = torch.randn(3, 64).bfloat16()
    out = lin(x, torch.float32)
    assert out.dtype == torch.float32 and torch.equal(
        out, w8a8_reference(x, qw, out_dtype=torch.float32)
    )


def test_packed_layout() -> None:
    q = torch.randint(-127, 128, (20, 70), dtype=torch.int8)
    packed, wsum = pack_w8a8(q)
    assert packed.numel() == 32 * 128 and torch.equal(wsum, q.int().sum(1))
    blocks = packed.reshape(2, 32, 16, 4)  # [block][quad][row][4]
    assert (
        blocks[1, 3, 2, 1] == q[18, 13] and blocks[0, 18, 0, :].abs().sum() == 0
    )  # k >= 70 is zero


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("march", ["x86-64-v2", "skylake-avx512", "icelake-server"])
def test_other_builds_equal_reference(march: str, tmp_path: Path) -> None:
    """Portable C, AVX-512BW without VNNI, VNNI without AMX: what CI's and other CPUs compile."""
    skip_unless_runs_here(march)
    kdir = Path(engine.kernels.__file__).parent
    so = tmp_path / f"{march}.so"
    subprocess.run(
        [
            "gcc",
            "-O2",
            f"-march={march}",
            "-fopenmp",
            "-fPIC",
            "-shared",
            "-ffp-contract=off",
            f"-I{kdir}",
            str(kdir / "qgemm_w8a8.c"),
            "-o",
            str(so),
            "-lm",
        ],
        check=True,
    )
    plib = ctypes.CDLL(str(so))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    plib.qlinear_w8a8.argtypes = [p, i64, i32, i32, p, p, p, i64, p, p, i64, i32, i32, i32]
    n, k = 70, 200
    g = torch.Generator().manual_seed(7)
    qw = quantize(torch.randn(n, k, generator=g), "int8")
    packed, wsum = pack_w8a8(qw.q)
    if march != "x86-64-v2":
        flags = subprocess.run(
            ["gcc", f"-march={march}", "-dM", "-E", "-"], input="", capture_output=True, text=True
        ).stdout
        assert "__AVX512BW__" in flags
    gpacked, gwsum = pack_w8a8(qw.q, 128)
    for m in (1, 7, 20):
        x = torch.randn(m, k, generator=g).bfloat16()
        out = torch.empty(m, n).bfloat16()
        rc = plib.qlinear_w8a8(
            x.data_ptr(),
            k,
            m,
            k,
            packed.data_ptr(),
            qw.scales.data_ptr(),
            wsum.data_ptr(),
            n,
            None,
            out.data_ptr(),
            n,
            1,
            0,
            0,
        )
        assert rc == 0 and torch.equal(out, w8a8_reference(x, qw)), f"{march} m={m}"
        rc = plib.qlinear_w8a8(
            x.data_ptr(),
            k,
            m,
            k,
            gpacked.data_ptr(),
            qw.scales.data_ptr(),
            gwsum.data_ptr(),
            n,
            None,
            out.data_ptr(),
            n,
            1,
            0,
            128,
        )
        assert rc == 0 and torch.equal(out, w8a8_reference(x, qw, group=128)), (
            f"{march} m={m} grouped"
        )


_GREEDY = """
import json, sys
from engine import LLM, SamplingParams
from tests.engine.test_correctness import prompts
llm = LLM(sys.argv[1], dtype=sys.argv[3], quantization=sys.argv[2], max_model_len=256)
ps = prompts(llm.engine.model_config.vocab_size, [5, 17, 40, 3])
outs = llm.generate(ps, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
print(json.dumps([o.token_ids for o in outs]))
"""


def _greedy(model: Path, scheme: str, dtype: str, kernels: bool) -> list[list[int]]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    env.pop("DUET_DISABLE_KERNELS", None)
    if not kernels:
        env["DUET_DISABLE_KERNELS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _GREEDY, str(model), scheme, dtype],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_kernels
@pytest.mark.parametrize("scheme", ["int8-w8a8", "int4-w4a8"])
def test_engine_greedy_equals_torch_reference_arithmetic(tiny_llama: Path, scheme: str) -> None:
    """fp32 activations: the kernels' attention and norms round like torch's within fp32, and the
    W8A8 GEMMs are bitwise the reference, so greedy tokens must match."""
    got = _greedy(tiny_llama, scheme, "float32", kernels=True)
    ref = _greedy(tiny_llama, scheme, "float32", kernels=False)
    assert got == ref


def test_smoothing_is_an_exact_reparametrization(tiny_llama: Path) -> None:
    """SmoothQuant (engine/quant_smooth.py): calibrated ranges of every smoothed linear's input,
    then norm * W, W_o through the v rows it reads, and down through up's rows are unchanged in
    full precision — only how the range is split between activation and weight moves."""
    from safetensors.torch import load_file

    from engine.model_config import ModelConfig
    from engine.quant_smooth import PARTS, activation_ranges, smooth_raw

    cfg = ModelConfig.from_dir(tiny_llama)
    ranges = activation_ranges(tiny_llama, cfg)
    assert len(ranges) == cfg.num_layers and all((r[p] > 0).all() for r in ranges for p in PARTS)
    raw = {k: v.float() for k, v in load_file(str(tiny_llama / "model.safetensors")).items()}
    new = dict(raw)
    smooth_raw(new, cfg, ranges, "model.", parts=frozenset(PARTS))
    d, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    kv_of = torch.tensor([(h // group) * d + i for h in range(cfg.num_heads) for i in range(d)])

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for x, norm in (
            ("self_attn.q_proj", "input_layernorm"),
            ("mlp.gate_proj", "post_attention_layernorm"),
        ):
            same(
                new[p + x + ".weight"] * new[p + norm + ".weight"],
                raw[p + x + ".weight"] * raw[p + norm + ".weight"],
            )
        v, o, down, up, n1, n2 = (
            p + n
            for n in (
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.down_proj.weight",
                "mlp.up_proj.weight",
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
            )
        )
        # each q head reads its kv head's v rows; v's and up's columns carry their input
        # norm's scale
        same(new[o] @ (new[v][kv_of] * new[n1]), raw[o] @ (raw[v][kv_of] * raw[n1]))
        assert not torch.equal(new[o], raw[o])  # something did move
        same(new[down] @ (new[up] * new[n2]), raw[down] @ (raw[up] * raw[n2]))


def test_int4_w4a8_keeps_the_int4_weights_unsmoothed(tiny_llama: Path) -> None:
    """int4-w4a8 computes with the int4 scheme's weights exactly (a 4-bit checkpoint's groups are
    recovered without error); only int8-w8a8 is smoothed. Smoothing int4-w4a8 scaled each column
    before the 4-bit requantization: SmolLM2's perplexity went from +2.7 % to +10.3 % of bf16."""
    import torch

    from engine.model_config import ModelConfig
    from engine.weights import load_weights

    cfg = ModelConfig.from_dir(tiny_llama)
    cpu = torch.device("cpu")
    plain = load_weights(tiny_llama, cfg, torch.float32, cpu, "int4", use_cache=False)
    w4a8 = load_weights(tiny_llama, cfg, torch.float32, cpu, "int4-w4a8", use_cache=False)
    for a, b in zip(plain.layers, w4a8.layers, strict=True):
        for part in ("qkv", "o", "gate_up", "down"):
            x, y = getattr(a, part), getattr(b, part)
            assert torch.equal(x.q, y.q) and torch.equal(x.scales, y.scales), part
        assert torch.equal(a.input_norm, b.input_norm) and torch.equal(a.post_norm, b.post_norm)
    smoothed = load_weights(tiny_llama, cfg, torch.float32, cpu, "int8-w8a8", use_cache=False)
    int8 = load_weights(tiny_llama, cfg, torch.float32, cpu, "int8", use_cache=False)
    assert not torch.equal(
        smoothed.layers[0].input_norm, int8.layers[0].input_norm
    )  # int8-w8a8 is smoothed


def test_calibration_shorter_than_the_skipped_rows_is_refused(tiny_llama: Path) -> None:
    """A calibration text of at most SKIP tokens feeds no layer: a clear error, not ranges of
    None that fail later inside the smoothing arithmetic."""
    from engine.model_config import ModelConfig
    from engine.quant_smooth import activation_ranges

    with pytest.raises(ValueError, match="calibration text must be longer"):
        activation_ranges(tiny_llama, ModelConfig.from_dir(tiny_llama), text="hi")
