"""Node tests share tests/conftest.py's `pd_nodes` (one prefill, one decode, one colocated
node on the tiny model); COMMON is those nodes' arguments, for tests that start their own."""

from tests.procs import TINY_NODE_ARGS as COMMON

__all__ = ["COMMON"]
