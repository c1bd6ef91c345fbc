"""Real processes for tests (see bench.procs): every one is stopped at the end of its test."""

from bench.procs import Proc, duet_node, free_port, running

__all__ = ["Proc", "duet_node", "free_port", "running"]
