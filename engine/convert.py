"""GGUF → Hugging Face-format model directory, done once per file.

transformers dequantizes the GGUF tensors (and undoes llama.cpp's Q/K permutation) and
rebuilds the tokenizer from the GGUF vocabulary; we then write plain fp32 safetensors, a clean
`config.json` (no quantization section, so any loader takes it), the tokenizer files and the
chat template. fp32 because dequantized Q4_1 values are not exact in bf16; the engine casts at
load time.

Invariant: the destination appears complete or not at all (written to a sibling temporary
directory, renamed at the end); a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from runtime.models import ModelRef, is_model_dir

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress = _quiet) -> Path:
    """Convert `gguf_path` into `out_dir` (atomically). Returns `out_dir`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        progress(f"converting {gguf_path.name}: tokenizer")
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        progress(f"converting {gguf_path.name}: dequantizing weights to fp32")
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            # Tied: the loader rebuilds lm_head from the embedding; safetensors refuses aliases.
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        config["dtype"] = "float32"
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        gen = GenerationConfig.from_model_config(model.config)
        gen.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "duet-source.json").write_text(json.dumps({"gguf": str(gguf_path)}) + "\n")
        del model
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def ensure_converted(ref: ModelRef, progress: Progress = _quiet) -> Path:
    """The model directory for `ref`, converting a `.gguf` the first time it is seen."""
    if ref.gguf_path is not None and not is_model_dir(ref.directory):
        convert_gguf(ref.gguf_path, ref.directory, progress)
    return ref.directory
