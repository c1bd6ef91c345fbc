"""Real processes for tests (see bench.procs): every one is stopped at the end of its test.

`three_nodes` is the one definition of the usual P/D set (one prefill, one decode, one
colocated node); tests/conftest.py's `pd_nodes` fixture runs it on the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.procs import Proc, duet_node, free_port, running

__all__ = ["TINY_NODE_ARGS", "Proc", "duet_node", "free_port", "running", "three_nodes"]

#: a node on the tiny model: fp32, a small KV pool, a short context
TINY_NODE_ARGS = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")


@contextmanager
def three_nodes(model: str | Path, tmp: Path, *args: str,
                prefill_args: tuple[str, ...] = ()) -> Iterator[tuple[Proc, Proc, Proc]]:  # fmt: skip
    """A prefill, a decode and a colocated node of `model`, running until the block ends."""
    p = duet_node("prefill", model, tmp, *args, *prefill_args)
    d = duet_node("decode", model, tmp, *args)
    both = duet_node("both", model, tmp, *args)
    with running(p, d, both):
        yield p, d, both
