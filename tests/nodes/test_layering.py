"""The node's layering (DESIGN §2): node/ reaches an engine only through node/engine_api.py, and
only node/engines/native.py imports engine/; node/ never imports prefill/ or decode/; the roles
import node/, never the other way round, and of node/ only its role API (node.legs) and the
engine interface (node.engine_api). No public function on the node's request path takes or
returns a `dict[str, Any]` (a wire message is a msgspec Struct of protocol/; only the vLLM
adapter, node/engines/vllm*.py, hands vLLM its dicts). Checked on the source (every import
statement, also the ones inside functions; every annotation) and at run time (importing node
modules loads no engine/prefill/decode module)."""

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
        assert not tops & {"prefill", "decode", "duet", "gateway", "bench"}, (
            f"{rel} imports an upper layer"
        )
        if rel != "node/engines/native.py":
            assert "engine" not in tops, f"{rel} imports engine/ (only node/engines/native.py may)"


def test_roles_do_not_import_engine_or_each_other() -> None:
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        for f in sorted((ROOT / role).rglob("*.py")):
            tops = {top(m) for m in imports(f)}
            assert not tops & {"engine", other, "duet"}, (
                f"{f.relative_to(ROOT)} imports {tops & {'engine', other}}"
            )


#: what a role may import of ours: its own package, and of the others these modules or packages
ROLE_MAY_IMPORT = ("node.legs", "node.engine_api", "protocol", "runtime", "text", "kvtransfer")
OURS = {
    "node",
    "engine",
    "prefill",
    "decode",
    "gateway",
    "coordinator",
    "protocol",
    "runtime",
    "text",
    "kvtransfer",
    "bench",
    "duet",
}


def test_roles_import_only_the_role_api_of_node() -> None:
    for role in ("prefill", "decode"):
        files = sorted((ROOT / role).rglob("*.py"))
        assert files
        for f in files:
            for m in imports(f):
                if top(m) not in OURS or top(m) == role:
                    continue
                ok = any(m == allowed or m.startswith(allowed + ".") for allowed in ROLE_MAY_IMPORT)
                assert ok, (
                    f"{f.relative_to(ROOT)} imports {m}; a role imports only {ROLE_MAY_IMPORT} of "
                    "ours"
                )


def _public_functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Module-level functions and methods of module-level classes whose names are public."""
    out: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith(
            "_"
        ):
            out.append(node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            out.extend(
                n
                for n in node.body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                and (not n.name.startswith("_") or n.name == "__init__")
            )
    return out


def test_no_public_function_on_the_request_path_takes_or_returns_a_raw_dict() -> None:
    files = [
        f
        for pkg in ("node", "prefill", "decode")
        for f in sorted((ROOT / pkg).rglob("*.py"))
        if not f.relative_to(ROOT).as_posix().startswith("node/engines/vllm")
    ]
    assert files
    bad = []
    for f in files:
        for fn in _public_functions(ast.parse(f.read_text())):
            a = fn.args
            annotated = [
                x.annotation
                for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                if x is not None and x.annotation is not None
            ]
            annotated += [fn.returns] if fn.returns is not None else []
            if any(
                "dict[str, Any]" in ast.unparse(t).replace("'", "").replace('"', "")
                for t in annotated
            ):
                bad.append(f"{f.relative_to(ROOT)}:{fn.lineno} {fn.name}")
    assert not bad, (
        f"public functions taking or returning dict[str, Any] (use a protocol/ Struct): {bad}"
    )


def test_importing_node_loads_no_engine_or_role() -> None:
    code = (
        "import sys, node.app, node.server, node.completions, node.responder, node.legs, "
        "node.leg_context, node.engine_api, node.engines\nbad = sorted(m for m in sys.modules if "
        "m.split('.')[0] in ('engine', 'prefill', 'decode', 'torch'))\nprint(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"node modules pulled in: {out.stdout.strip()}"
