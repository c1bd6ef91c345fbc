"""The node's layering (DESIGN §2): node/ reaches an engine only through node/engine_api.py, and
only node/engines/native.py imports engine/; node/ never imports prefill/ or decode/; the roles
import node/, never the other way round. Checked on the source (every import statement, also
the ones inside functions) and at run time (importing node modules loads no engine/prefill/
decode module)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def top(name: str) -> str:
    return name.split(".")[0]


def test_node_imports_no_role_and_engine_only_in_the_native_adapter() -> None:
    files = sorted((ROOT / "node").rglob("*.py"))
    assert files
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        tops = {top(m) for m in imports(f)}
        assert not tops & {"prefill", "decode", "duet", "gateway", "bench"}, f"{rel} imports an upper layer"
        if rel != "node/engines/native.py":
            assert "engine" not in tops, f"{rel} imports engine/ (only node/engines/native.py may)"


def test_roles_do_not_import_engine_or_each_other() -> None:
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        for f in sorted((ROOT / role).rglob("*.py")):
            tops = {top(m) for m in imports(f)}
            assert not tops & {"engine", other, "duet"}, f"{f.relative_to(ROOT)} imports {tops & {'engine', other}}"


def test_importing_node_loads_no_engine_or_role() -> None:
    code = (
        "import sys, node.app, node.server, node.completions, node.responder, node.legs, node.engine_api, "
        "node.engines\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'prefill', 'decode', 'torch'))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"node modules pulled in: {out.stdout.strip()}"
