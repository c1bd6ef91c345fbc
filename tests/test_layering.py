"""The request path's layering rules (docs/architecture.md), checked on the source by
AST — every import statement, also the ones inside functions:

- the gateway imports no node, engine, role or transport module (nor torch): it speaks to nodes
  only through protocol/'s wire types;
- prefill/ and decode/ reach node/ only through its role API (node.legs) and the engine seam
  (node.engine_api);
- no public function on the request path takes or returns `dict[str, Any]`: wire messages are
  msgspec Structs (protocol/), in-process records are dataclasses;
- bench/ imports only protocol/, runtime/, text/ and bench/ (it talks HTTP), except the component benchmarks
  listed here, each importing the one package it measures.

(tests/nodes/test_layering.py keeps the node's own rules: engine/ only in the native adapter.)
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.nodes.test_layering import imports, top

ROOT = Path(__file__).resolve().parents[1]

#: modules a request crosses, gateway → coordinator client → node legs (their public
#: functions are the seams the rule guards)
REQUEST_PATH = [
    "gateway/serving/pipeline.py",
    "gateway/serving/requests.py",
    "gateway/serving/measure.py",
    "gateway/accounts/ledger.py",
    "gateway/backends/base.py",
    "gateway/backends/cluster/backend.py",
    "gateway/backends/node_client.py",
    "gateway/serving/relay.py",
    "gateway/serving/openai_format.py",
    "gateway/backends/provider.py",
    "gateway/backends/routing.py",
    "gateway/serving/choice.py",
    "coordinator/client.py",
    "node/completions.py",
    "node/legs.py",
    "node/responder.py",
    "node/chat.py",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "prefill").glob("*.py")),
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "decode").glob("*.py")),
    "protocol/node_api.py",
    "protocol/kv_params.py",
    "protocol/openai.py",
    "protocol/route.py",
    "protocol/sse.py",
]

#: bench modules that measure one package by importing it (name → what it may import: that
#: package; bench/profile.py also writes its profile in sim/'s schema, which the simulator reads)
COMPONENT_BENCHMARKS = {
    "bench/engine.py": {"engine"},
    "bench/engine_runs.py": {"engine"},
    "bench/flops.py": {"engine"},
    "bench/quality.py": {"engine"},
    "bench/quant_engine.py": {"engine"},
    "bench/linear_rows.py": {"engine"},
    "bench/kernel_ab.py": {"engine"},
    "bench/kvtransfer.py": {"kvtransfer"},
    "bench/kv_tiers.py": {"engine"},
    "bench/route.py": {"coordinator"},
    "bench/router.py": {"gateway"},
    "bench/profile.py": {"engine", "sim"},
    "bench/engine_tiers.py": {"engine"},
    "bench/spec_engine.py": {"engine"},
    "bench/lora_engine.py": {"engine"},
    "bench/sleep_engine.py": {"engine"},
    "bench/structured.py": {"engine"},
    "bench/probes/linear_bf16_vs_onednn.py": {"engine"},
    "bench/probes/decode_linears.py": {"engine"},
}


def py_files(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    return files


def test_the_gateway_imports_no_node_engine_or_role() -> None:
    banned = {"node", "engine", "prefill", "decode", "kvtransfer", "torch", "duet", "bench"}
    for f in py_files("gateway"):
        bad = {top(m) for m in imports(f)} & banned
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_roles_reach_node_only_through_its_role_api() -> None:
    allowed = {"node.legs", "node.engine_api"}
    for role in ("prefill", "decode"):
        for f in py_files(role):
            bad = {m for m in imports(f) if top(m) == "node" and m not in allowed}
            assert not bad, (
                f"{f.relative_to(ROOT)} imports {sorted(bad)} (only {sorted(allowed)} of node/)"
            )


def _any_dict(annotation: ast.expr | None) -> bool:
    return annotation is not None and "dict[str, Any]" in ast.unparse(annotation)


def test_no_public_function_on_the_request_path_speaks_dict_any() -> None:
    offenders = []
    for rel in REQUEST_PATH:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith(
                "_"
            ):
                continue
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            if _any_dict(node.returns) or any(_any_dict(a.annotation) for a in args):
                offenders.append(f"{rel}:{node.lineno} {node.name}")
    assert not offenders, "public functions taking or returning dict[str, Any]: " + ", ".join(
        offenders
    )


def test_bench_talks_http_except_the_component_benchmarks() -> None:
    ours = {
        "engine",
        "kvtransfer",
        "coordinator",
        "gateway",
        "node",
        "prefill",
        "decode",
        "duet",
        "sim",
    }
    for f in py_files("bench"):
        rel = f.relative_to(ROOT).as_posix()
        used = {top(m) for m in imports(f)} & ours
        allowed = COMPONENT_BENCHMARKS.get(rel, set())
        assert used <= allowed, (
            f"{rel} imports {sorted(used - allowed)} (bench/ talks HTTP; component "
            f"benchmarks are listed in COMPONENT_BENCHMARKS)"
        )


def test_the_lists_name_real_files() -> None:
    for rel in [*REQUEST_PATH, *COMPONENT_BENCHMARKS]:
        assert (ROOT / rel).is_file(), rel
