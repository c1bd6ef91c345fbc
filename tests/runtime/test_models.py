from pathlib import Path

import pytest

from runtime.models import DEFAULT_MODEL, ModelNotFoundError, resolve_model


def test_unknown_name_says_what_is_known(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUET_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=DEFAULT_MODEL):
        resolve_model("no-such-model")


def test_registry_name_not_pulled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUET_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="duet models pull"):
        resolve_model(DEFAULT_MODEL)


def test_directory_and_gguf(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))
    ref = resolve_model(str(tiny_llama))
    assert ref.directory == tiny_llama and not ref.needs_conversion
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_model(tmp_path / "empty")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    ref = resolve_model(gguf)
    assert ref.needs_conversion and ref.directory.is_relative_to(tmp_path / "home")
    assert ref.name == "m"
