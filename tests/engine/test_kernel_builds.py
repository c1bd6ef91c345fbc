"""The kernels built for another x86 level than this machine's, side by side with the engine's own
(engine.kernels.build_library's `march`; tests/engine/isa.py's `library`): each build says which
paths it carries, and runs where this CPU can run it. The kernel tests compare their outputs level
against level through the same helper.
"""

from __future__ import annotations

import platform

import pytest
import torch

from engine.kernels import kernels_lib
from tests.engine import isa

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 ISA levels")

#: -march → what kernels_isa() says of that build (0 portable ... 4 AMX)
LEVELS = {
    isa.PORTABLE: 0,
    isa.AVX2: 1,
    isa.AVX512: 2,
    isa.AVX512_VNNI: 2,
    isa.AVX512_BF16: 3,
    isa.AMX: 4,
}


@pytest.mark.parametrize("march", list(LEVELS))
def test_a_build_for_each_level_carries_its_paths(march: str) -> None:
    lib = isa.library(march)
    assert lib.kernels_isa() == LEVELS[march]
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    x[1, 7] = x[1, 900] = 50.0  # a tie: the first index wins, as in torch
    out = torch.empty(3, dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), x.stride(0), 3, 1000, 0, out.data_ptr())
    assert out.tolist() == x.argmax(dim=1).tolist()


def test_the_engine_build_is_this_cpus_level() -> None:
    lib = kernels_lib()
    if lib is None:
        pytest.skip("no kernels here")
    want = max(v for m, v in LEVELS.items() if not isa.needs(m) - isa.cpu_flags())
    assert lib.kernels_isa() >= want
    assert isa.library(isa.PORTABLE) is not lib
