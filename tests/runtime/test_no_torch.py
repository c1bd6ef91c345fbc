"""protocol/, runtime/ and text/ must import without torch: the gateway and bench never load it."""

import pkgutil
import subprocess
import sys

import protocol
import runtime
import text


def test_the_torch_free_packages_import_without_torch() -> None:
    names = [
        f"{pkg.__name__}.{m.name}"
        for pkg in (protocol, runtime, text)
        for m in pkgutil.iter_modules(pkg.__path__)
    ]
    assert {"protocol.block_hash", "runtime.tracing", "text.tokenizer"} <= set(names)
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"a torch-free package pulled in torch: {proc.stdout} {proc.stderr}"
    )
