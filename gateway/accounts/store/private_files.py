"""Files the gateway keeps — its store, the batch store, uploaded batch files — are the teams'
data and the operator's: created 0600 in a 0700 directory, whatever the process umask.

`private_dir` creates a missing directory 0700 (an existing one is the operator's choice and
keeps its mode); `private_file` creates a missing file 0600 and tightens an existing one to
0600 (a file an older version created with the umask's 0644 stops being readable by others);
`open_private` opens a new file for writing, 0600 from its first byte; `durable_replace`
moves a written file into place and fsyncs the directory, so the rename survives a crash.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path) -> Path:
    if not path.exists():
        path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        os.chmod(path, DIR_MODE)  # mkdir's mode is masked by the umask
    return path


def private_file(path: Path) -> Path:
    if path.exists():
        if path.stat().st_mode & 0o777 != FILE_MODE:
            os.chmod(path, FILE_MODE)
    else:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, FILE_MODE))
        os.chmod(path, FILE_MODE)  # exact, whatever the umask
    return path


def open_private(path: Path) -> BinaryIO:
    """A new file at `path` for writing, 0600 from the start (it must not exist)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
    return os.fdopen(fd, "wb")


def durable_replace(temp: Path, target: Path) -> None:
    os.replace(temp, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
