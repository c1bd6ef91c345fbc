"""Real node processes shared by a gateway test module: one prefill, one decode and one
colocated node on the tiny model (fp32, one thread each). Stopped at the end, pass or fail."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Proc, duet_node, running

COMMON = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def nodes(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("nodes")
    p = duet_node("prefill", tiny_llama, tmp, *COMMON, "--lease-seconds", "30")
    d = duet_node("decode", tiny_llama, tmp, *COMMON)
    both = duet_node("both", tiny_llama, tmp, *COMMON)
    with running(p, d, both):
        yield p, d, both
