"""The on-disk cache of a quantized model: `MODEL_DIR/quantized/SCHEME.safetensors`.

Written once by `duet models pull NAME --quantize SCHEME` beside the full-precision weights;
read by the engine at start-up instead of quantizing again. Each matrix is stored in its packed
kernel format (engine/quant.py) under `<name>.q`, `<name>.scales` and `<name>.mins`; the
metadata records the format version, the scheme, every matrix's shape and group, and the
size and mtime of the source safetensors files.

Invariant: a cache whose source files changed, whose version or scheme differs, or which cannot
be read is ignored (with a warning) and the engine quantizes in memory instead; the file is
written to a temporary name and renamed, so a reader never sees half of it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.quant import WEIGHT_FORMAT, QuantizedWeight, check_scheme

log = logging.getLogger("duet.engine.quant")

FORMAT_VERSION = 1


def cache_path(model_dir: Path, scheme: str) -> Path:
    """The cache of `scheme`'s weight format (the W8A8 schemes, whose weights are smoothed first
    (engine/quant_smooth.py), do not read it: engine/weights.py)."""
    return Path(model_dir) / "quantized" / f"{WEIGHT_FORMAT[check_scheme(scheme)]}.safetensors"


def _source_signature(model_dir: Path) -> list[list]:
    return [
        [f.name, f.stat().st_size, f.stat().st_mtime_ns]
        for f in sorted(Path(model_dir).glob("*.safetensors"))
    ]


def load_quantized(model_dir: Path, scheme: str) -> dict[str, QuantizedWeight] | None:
    """The cached matrices of `scheme`, or None when there is no valid cache."""
    scheme = WEIGHT_FORMAT[check_scheme(scheme)]
    path = cache_path(model_dir, scheme)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            info = json.loads(meta.get("duet", "{}"))
            if info.get("version") != FORMAT_VERSION or info.get("scheme") != scheme:
                log.warning("ignoring %s: written by another format version or scheme", path)
                return None
            if info.get("source") != _source_signature(model_dir):
                log.warning(
                    "ignoring %s: the model's weights changed since it was written "
                    "(run `duet models pull --quantize %s --force`)",
                    path,
                    scheme,
                )
                return None
            out = {}
            for name, m in info["matrices"].items():
                out[name] = QuantizedWeight(
                    scheme=m["scheme"],
                    out_features=m["out"],
                    in_features=m["in"],
                    q=f.get_tensor(f"{name}.q"),
                    scales=f.get_tensor(f"{name}.scales"),
                    mins=f.get_tensor(f"{name}.mins") if m["scheme"] == "int4" else None,
                    group=m["group"],
                )
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        log.warning("ignoring unreadable quantized cache %s: %s", path, e)
        return None
    return out


def write_quantized(model_dir: Path, scheme: str) -> Path:
    """Quantize the model at `model_dir` with `scheme` and write the cache; returns its path."""
    from engine.model_config import LLAMA_FAMILY, ModelConfig
    from engine.weights import load_weights

    scheme = WEIGHT_FORMAT[check_scheme(scheme)]
    cfg = ModelConfig.from_dir(Path(model_dir))
    if cfg.model_type not in LLAMA_FAMILY:
        # the other architectures (engine/models/) quantize their linears at load instead
        raise ValueError(
            f"a quantized cache is written for the Llama family only; {cfg.model_type} models "
            "are quantized when they load (--quantization), with no cache"
        )
    path = cache_path(model_dir, scheme)
    source = _source_signature(model_dir)
    w = load_weights(
        Path(model_dir),
        cfg,
        torch.float32,
        torch.device("cpu"),
        quantization=scheme,
        use_cache=False,
    )
    assert isinstance(w.lm_head, QuantizedWeight)  # loaded with quantization=scheme
    mats: dict[str, QuantizedWeight] = {"lm_head": w.lm_head}
    for i, lw in enumerate(w.layers):
        for part in ("qkv", "o", "gate_up", "down"):
            mats[f"model.layers.{i}.{part}"] = getattr(lw, part)
    tensors, info = {}, {}
    for name, qw in mats.items():
        tensors[f"{name}.q"] = qw.q
        tensors[f"{name}.scales"] = qw.scales
        if qw.mins is not None:
            tensors[f"{name}.mins"] = qw.mins
        info[name] = {
            "scheme": qw.scheme,
            "out": qw.out_features,
            "in": qw.in_features,
            "group": qw.group,
        }
    meta = {
        "duet": json.dumps(
            {"version": FORMAT_VERSION, "scheme": scheme, "source": source, "matrices": info}
        )
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
