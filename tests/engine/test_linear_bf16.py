"""linear_bf16 (engine/kernels/linear_bf16.c) and engine/linear.py's Linear on it: bf16 linear
layers on the project's own GEMM on CPUs with AVX-512 BF16 (AMX or not), or AVX2 + FMA (the
weights widened to fp32 in registers).

- The kernel computes x @ W^T + bias with fp32 sums and one rounding (against an fp32 reference,
  odd shapes included: n not a multiple of 32, k not of 32, k odd).
- A row's output does not depend on the rows beside it: every row of a 300-row call equals the
  row computed alone and in 5-row calls, bitwise, on each path the CPU has (AMX, AVX-512 BF16,
  AVX2).
- Linear takes it wherever it is built (panels replace the weight; decode_bytes counts the panels),
  keeps oneDNN with DUET_BF16_LINEAR=onednn, and refuses an fp32 input with a clear error (AVX2,
  whose arithmetic is fp32 anyway, takes it).
Skipped where the CPU has neither (the kernel is not built there; test_linear_isa.py covers those
CPUs' paths).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import linear
from engine.kernels import kernels_lib

LIB = kernels_lib()
ISA = 0 if LIB is None else int(LIB.qgemm_bf16_isa())
pytestmark = pytest.mark.skipif(
    ISA == 0, reason="neither AVX-512 BF16 nor AVX2 on this CPU: linear_bf16 is not built"
)
SHAPES = [(37, 70), (64, 576), (33, 31), (160, 1536)]


def _pack(w: torch.Tensor) -> torch.Tensor:
    panels = torch.empty(LIB.linear_bf16_packed_words(*w.shape), dtype=torch.int32)
    assert LIB.linear_bf16_pack(w.data_ptr(), w.shape[0], w.shape[1], panels.data_ptr()) == 0
    return panels


def _call(
    x: torch.Tensor,
    panels: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    isa: int,
    out_f32: bool = True,
) -> torch.Tensor:
    out = torch.empty(x.shape[0], n, dtype=torch.float32 if out_f32 else torch.bfloat16)
    rc = LIB.linear_bf16(
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        x.shape[1],
        panels.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        int(out_f32),
        isa,
    )
    assert rc == 0
    return out


#: the paths this CPU runs: AMX and AVX-512 BF16, or AVX2's (3: the weights widened to fp32)
PATHS = [ISA] if ISA == 3 else [i for i in (1, 2) if i <= ISA]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_fp32_and_rows_do_not_depend_on_their_batch(
    isa: int, shape: tuple[int, int]
) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x = torch.randn(300, k, generator=g).bfloat16()
    panels = _pack(w)
    got = _call(x, panels, n, b, isa)
    want = x.float() @ w.float().T + b.float()
    # each product is exact in fp32; only the order of the fp32 sums differs from torch's
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4 * k**0.5)
    alone = torch.cat([_call(x[i : i + 1], panels, n, b, isa) for i in range(x.shape[0])])
    assert torch.equal(got, alone)
    # 9, 10 and 17 rows end on one 9- or 10-row pass (QB_MR_TAIL), 5 on a short one
    for size in (5, 9, 10, 17):
        assert torch.equal(
            got,
            torch.cat(
                [_call(x[i : i + size], panels, n, b, isa) for i in range(0, x.shape[0], size)]
            ),
        )
    # the bf16 store is the fp32 result rounded once (nearest even), as torch rounds it
    assert torch.equal(_call(x[:7], panels, n, b, isa, out_f32=False), got[:7].bfloat16())


def test_a_path_the_cpu_lacks_is_refused() -> None:
    w = torch.randn(32, 32).bfloat16()
    out = torch.empty(1, 32, dtype=torch.float32)
    x = torch.randn(1, 32).bfloat16()
    lacks = 1 if ISA == 3 else 3  # AVX2 builds have no AVX-512 BF16 path, and the converse
    assert (
        LIB.linear_bf16(
            x.data_ptr(), 32, 1, 32, _pack(w).data_ptr(), 32, None, out.data_ptr(), 32, 1, lacks
        )
        == -3
    )


#: Linear takes the kernel by default (AVX2 too) unless DUET_BF16_LINEAR=onednn (engine/linear.py)
layers_take_it = pytest.mark.skipif(
    ISA == 3 and not linear.avx2_bf16_layers(),
    reason="DUET_BF16_LINEAR=onednn in this environment: bf16 layers stay off the own GEMM",
)


@layers_take_it
def test_linear_takes_the_kernel_where_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(100, 64, generator=g).bfloat16(), torch.randn(100, generator=g).bfloat16()
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    layer = linear.Linear(w, b)
    assert layer.panels is not None and layer.weight is None and layer.packed is None
    assert layer.decode_bytes == layer.panels.nbytes + b.nbytes  # 128 padded rows of k = 64
    got = layer(x)
    assert got.shape == (2, 3, 100) and got.dtype == torch.bfloat16
    assert torch.allclose(
        got.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=2e-2
    )
    assert torch.equal(layer(x[:, 1:2]), got[:, 1:2])  # a strided slice of the batch, alone
    if ISA == 3:  # AVX2 widens the weights to fp32: fp32 rows are taken as they are
        assert torch.allclose(
            layer(x.float()), F.linear(x.float(), w.float(), b.float()), atol=1e-4
        )
    else:
        with pytest.raises(TypeError, match="float32"):
            layer(x.float())
    monkeypatch.setenv("DUET_BF16_LINEAR", "onednn")
    assert linear.Linear(w, b).panels is None


@layers_take_it
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536)])
def test_a_bf16_layers_rows_do_not_depend_on_their_batch(shape: tuple[int, int]) -> None:
    """What speculative decoding's greedy identity rests on, through Linear as the engine builds
    it on this CPU: a row computed alone (a decode step), among 6 (a verification of 5 drafts) and
    among 40 (a batch) is bitwise the same. oneDNN's prepacked bf16 failed this on Zen 4 at k = 1536
    (0.0625 apart), and bf16 self-speculation there was not greedy-identical."""
    n, k = shape
    g = torch.Generator().manual_seed(k)
    layer = linear.Linear(torch.randn(n, k, generator=g).bfloat16())
    x = torch.randn(40, k, generator=g).bfloat16()
    full = layer(x)
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(40)]), full)
    assert torch.equal(torch.cat([layer(x[i : i + 6]) for i in range(0, 36, 6)]), full[:36])
