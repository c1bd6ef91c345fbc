"""The gateway never imports torch or engine/ (DESIGN §2): it must start on a machine without
them, and fast."""

import pkgutil
import subprocess
import sys

import gateway


def test_gateway_imports_without_torch_or_engine() -> None:
    names = [
        "gateway",
        *(m.name for m in pkgutil.walk_packages(gateway.__path__, prefix="gateway.")),
        "duet.cmd_gateway",
    ]
    assert "gateway.app" in names and "gateway.accounts.store.sqlite" in names
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        "import gateway.app, gateway.server\n"
        "gateway.app.make_app  # the whole app graph is loaded\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'engine', 'node', 'transformers'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"the gateway pulled in: {proc.stdout} {proc.stderr}"
