"""protocol/ must import without torch: the gateway and bench never load it."""

import pkgutil
import subprocess
import sys

import protocol


def test_protocol_imports_without_torch() -> None:
    names = [f"protocol.{m.name}" for m in pkgutil.iter_modules(protocol.__path__)]
    assert "protocol.block_hash" in names and "protocol.tokenizer" in names
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"protocol pulled in torch: {proc.stdout} {proc.stderr}"
