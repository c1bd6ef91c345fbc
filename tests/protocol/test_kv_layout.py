import msgspec
import pytest

from protocol.kv_layout import KVLayout


def _layout(**kw: object) -> KVLayout:
    base = dict(
        num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16", num_blocks=100
    )
    base.update(kw)
    return KVLayout(**base)  # type: ignore[arg-type]


def test_block_bytes_and_offsets() -> None:
    lay = _layout()
    assert lay.block_bytes == 30 * 2 * 16 * 3 * 64 * 2
    assert lay.block_offset(7) == 7 * lay.block_bytes
    with pytest.raises(IndexError, match="out of range"):
        lay.block_offset(100)
    with pytest.raises(IndexError):
        lay.block_offset(-1)


def test_compat_ignores_capacity_and_names_differences() -> None:
    a, b = _layout(), _layout(num_blocks=5)
    assert a.compat_hash == b.compat_hash and a.differences(b) == []
    c = _layout(dtype="float32", head_dim=128)
    assert c.compat_hash != a.compat_hash
    assert a.differences(c) == ["head_dim: 64 != 128", "dtype: bfloat16 != float32"]


def test_roundtrip_wire() -> None:
    lay = _layout()
    assert msgspec.json.decode(msgspec.json.encode(lay), type=KVLayout) == lay


def test_quantized_weights_never_pair_with_unquantized() -> None:
    """The KV of an int4 prefill is not the KV a bf16 decode node would compute: the layouts are
    byte-compatible but must not pair (the hash differs and the refusal says why)."""
    plain, int4 = _layout(), _layout(weights="int4")
    assert plain.compat_hash == _layout(weights="").compat_hash  # unquantized hashes unchanged
    assert int4.compat_hash != plain.compat_hash != _layout(weights="int8").compat_hash
    assert plain.differences(int4) == ["weights: unquantized != int4"]


def test_architectures_past_llama_enter_the_hash() -> None:
    """Gemma's KV, read with its per-layer windows, must not pair with a same-shaped Llama's;
    the Llama family's hash stays what it was (attention "")."""
    gemma = _layout(attention="gemma2;window=4096;layers=sfsf")
    assert gemma.compat_hash != _layout().compat_hash
    assert _layout().differences(gemma) == ["attention: llama != gemma2;window=4096;layers=sfsf"]
