"""Processes that start together build the kernels once (engine/kernels `_compile`): the build
runs under a file lock in `$DUET_KERNEL_CACHE`, and whoever waited loads the library the first
one built. Before, each process of a node set compiled every source itself, side by side.

The compiler here is gcc behind a script that logs each call and takes a few seconds per
source, so the three processes surely overlap.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

_CODE = "from engine.kernels import kernels_lib\nprint('kernels', kernels_lib() is not None)"


def _slow_logging_cc(tmp: Path) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler here")
    cc = tmp / "cc"
    cc.write_text(f'#!/bin/sh\necho "$*" >> {tmp / "calls.log"}\nsleep 1\nexec {gcc} "$@"\n')
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    return cc


def test_processes_starting_together_build_the_kernels_once(tmp_path: Path) -> None:
    cc = _slow_logging_cc(tmp_path)
    env = dict(os.environ, CC=str(cc), DUET_KERNEL_CACHE=str(tmp_path / "cache"))
    procs = [
        subprocess.Popen([sys.executable, "-c", _CODE], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all("kernels True" in o for o in outs), outs
    calls = (tmp_path / "calls.log").read_text().splitlines()
    links = [c for c in calls if "-shared" in c]
    assert len(links) == 1, f"{len(links)} builds for one key: {calls}"
    assert len(list((tmp_path / "cache").glob("duet_kernels-*.so"))) == 1
