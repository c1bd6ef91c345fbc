"""What this CPU is: model name and ISA flags, read once from /proc/cpuinfo (empty elsewhere).

Used to pick the default dtype, to key the compiled-kernel cache, and by bench to report the
machine.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset[str]()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name") and not model:
                model = ln.split(":", 1)[1].strip()
            elif ln.startswith("flags") and not flags:
                flags = frozenset(ln.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    return _cpuinfo()[1]
