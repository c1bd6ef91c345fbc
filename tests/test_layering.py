"""The repository's layering rules (docs/architecture.md), checked on the source by AST — every
import statement, also the ones inside functions and under TYPE_CHECKING:

- the gateway imports no node, engine, role or transport module (nor torch): it speaks to nodes
  only through protocol/'s wire types;
- the gateway's packages follow one declared order (`GATEWAY_LAYERS`): no module imports from
  a layer above its own, and no import cycle runs through gateway/;
- gateway/'s top holds only the composition root and its config (at most 12 modules), and no
  gateway module is longer than 400 lines;
- a public function on the request path (`REQUEST_PATH`) is at most 60 lines long and takes at
  most 6 parameters, unless listed in `REQUEST_PATH_EXCEPTIONS` with its reason;
- no public function in gateway/, node/, decode/ or prefill/ takes or returns `dict[str, Any]`
  (wire messages are msgspec Structs of protocol/, in-process records are dataclasses), except
  where `DICT_ANY_EXEMPT` says why;
- prefill/ and decode/ reach node/ only through its role API (node.legs) and the engine seam
  (node.engine_api);
- bench/ imports only protocol/, runtime/, text/ and bench/ (it talks HTTP), except the
  component benchmarks listed here, each importing the one package it measures.

Each checker is a function of the source, shown failing on a planted violation (the `planted`
tests), so a rule that stopped catching anything would fail here too.
(tests/nodes/test_layering.py keeps the node's own rules: engine/ only in the native adapter.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

from tests.nodes.test_layering import imports, top

ROOT = Path(__file__).resolve().parents[1]

#: gateway/'s layers, bottom first: a module may import its own layer and the ones below. A
#: module's layer is that of the longest prefix naming it.
GATEWAY_LAYERS: list[tuple[str, ...]] = [
    ("gateway.tools",),  # tool-call formats and parsers: nothing of the gateway's
    ("gateway.backends.providers",),  # the commercial API clients, self-contained
    (
        "gateway.config",
        "gateway.config_tables",
        "gateway.config_features",
        "gateway.config_checks",
        "gateway.config_adapters",
        "gateway.config_versions",
        "gateway.metrics",
    ),
    # the checked request and the batch rows: the data every layer above reads
    (
        "gateway.serving.requests",
        "gateway.serving.raw_body",
        "gateway.serving.chat",
        "gateway.serving.constraint",
        "gateway.serving.features",
        "gateway.batch.rows",
        "gateway.batch.models",
    ),
    ("gateway.accounts",),
    ("gateway.backends",),
    ("gateway.serving",),
    ("gateway.state",),
    ("gateway.batch",),
    ("gateway.api",),
    ("gateway.console",),
    ("gateway.app", "gateway.server", "gateway.conn_limits", "gateway"),
]
#: at most this many modules at gateway/'s top (the composition root and its config)
GATEWAY_TOP_MAX = 12
#: no gateway module is longer than this
GATEWAY_FILE_MAX = 400

#: modules a request crosses, API → pipeline → backend → coordinator client → node legs
#: (their public functions are the seams the rules guard)
REQUEST_PATH = [
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "gateway/serving").glob("*.py")),
    *sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "gateway/backends/cluster").glob("*.py")
    ),
    "gateway/api/openai.py",
    "gateway/api/embeddings.py",
    "gateway/api/translated.py",
    "gateway/accounts/ledger.py",
    "gateway/backends/base.py",
    "gateway/backends/node_client.py",
    "gateway/backends/routing.py",
    "gateway/backends/provider.py",
    "gateway/backends/embedding.py",
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
    "protocol/limits.py",
    "protocol/route.py",
    "protocol/sse.py",
]
#: request-path functions allowed past 60 lines or 6 parameters, and why
REQUEST_PATH_EXCEPTIONS = {
    "protocol/openai.py::APIError.__init__": "OpenAI's four error fields, the status, and the "
    "two header fields every process renders",
}
#: where `dict[str, Any]` may cross a public signature (a path, or a folder's prefix), and why
DICT_ANY_EXEMPT = {
    "gateway/serving/raw_body.py": "the client's raw JSON body before any check: the one place "
    "a request is untyped",
    "gateway/backends/providers/": "the commercial providers' JSON bodies, passed to and from "
    "their APIs as those APIs define them",
    "gateway/backends/provider_usage.py": "a provider's stream chunks (its JSON, as above), "
    "read on for their usage after the client left",
    "gateway/tools/": "JSON Schemas and a chat template's tool turns are JSON objects by nature",
    "gateway/accounts/store/": "the /v1/usage rows the database computes and the batch results "
    "it keeps are JSON answered as they are",
    "gateway/batch/": "a batch line's body and its result are the client's JSON, kept and "
    "answered as they are",
    "gateway/console/": "the console renders the gateway API's own JSON answers",
    "gateway/api/admin.py": "the /v1/usage record rows it answers are JSON",
    "gateway/config.py": "gateway.toml as read: a TOML table",
    "gateway/config_adapters.py": "an adapter's [models.*] table completed from its base's, as "
    "read, before it is checked like any model's",
    "gateway/config_checks.py": "a [models.X] table as read, and a provider's table",
    "node/engines/vllm_sampling.py": "vLLM's own API takes and gives dicts",
    "node/engines/vllm_config.py": "vLLM's engine arguments are a dict",
}

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
    "bench/attention_ab.py": {"engine"},
    "bench/decode_ab.py": {"engine"},
    "bench/kvtransfer.py": {"kvtransfer"},
    "bench/kv_tiers.py": {"engine"},
    "bench/kv_int8.py": {"engine"},
    "bench/kv_int8_prefix.py": {"engine"},
    "bench/route.py": {"coordinator"},
    "bench/rollout_plane.py": {"coordinator"},  # its etcd (coordinator/etcd_server.py)
    "bench/router.py": {"gateway"},
    "bench/batch_listing.py": {"gateway"},  # the batch store's listing
    "bench/batch_claims.py": {"gateway"},  # the batch store's claim
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


def sources(*packages: str) -> dict[str, str]:
    """Path (relative, posix) → source of every module of `packages`."""
    return {f.relative_to(ROOT).as_posix(): f.read_text() for p in packages for f in py_files(p)}


# -- the checkers: functions of the source, so a planted violation can be shown caught ----------


def module_name(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def import_graph(modules: Mapping[str, str]) -> dict[str, set[str]]:
    """Module → the modules of `modules` it imports (`from P import m`, m a module: P.m)."""
    graph: dict[str, set[str]] = {}
    for name, source in modules.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                found = [s for s in subs if s in modules]
                out.update(found)
                if len(found) < len(subs):
                    out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[name] = {m for m in out if m in modules and m != name}
    return graph


def layer_of(module: str, layers: list[tuple[str, ...]] = GATEWAY_LAYERS) -> int:
    best, depth = -1, -1
    for i, prefixes in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    assert best >= 0, f"{module} is in no layer of GATEWAY_LAYERS"
    return best


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} imports {b} (a layer above)"
        for a, bs in graph.items()
        for b in bs
        if layer_of(b) > layer_of(a)
    )


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef]]:
    """(qualified name, node) of every function, methods as `Class.method`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}{node.name}", node  # type: ignore[misc]
            yield from functions(node, f"{prefix}{node.name}.")


def _public(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return not last.startswith("_") or last == "__init__"


def long_or_wide(modules: Mapping[str, str], exceptions: Mapping[str, str]) -> list[str]:
    """Public functions (constructors too) over 60 lines or 6 parameters, not excepted."""
    out = []
    for path, source in modules.items():
        for name, f in functions(ast.parse(source)):
            a = f.args
            params = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            n = (
                len([p for p in params if p not in ("self", "cls")])
                + bool(a.vararg)
                + bool(a.kwarg)
            )
            lines = (f.end_lineno or f.lineno) - f.lineno + 1
            if _public(name) and (n > 6 or lines > 60) and f"{path}::{name}" not in exceptions:
                out.append(f"{path}:{f.lineno} {name} ({lines} lines, {n} parameters)")
    return out


def _any_dict(annotation: ast.expr | None) -> bool:
    return annotation is not None and "dict[str, Any]" in ast.unparse(annotation)


def dict_any_offenders(modules: Mapping[str, str], exempt: Mapping[str, str]) -> list[str]:
    out = []
    for path, source in modules.items():
        if any(path == e or (e.endswith("/") and path.startswith(e)) for e in exempt):
            continue
        for name, f in functions(ast.parse(source)):
            a = f.args
            args = [*a.posonlyargs, *a.args, *a.kwonlyargs]
            if not name.rsplit(".", 1)[-1].startswith("_") and (
                _any_dict(f.returns) or any(_any_dict(x.annotation) for x in args)
            ):
                out.append(f"{path}:{f.lineno} {name}")
    return out


def oversized(modules: Mapping[str, str], most: int = GATEWAY_FILE_MAX) -> list[str]:
    return sorted(
        f"{p} ({n} lines)" for p, s in modules.items() if (n := len(s.splitlines())) > most
    )


# -- the rules on the repository -----------------------------------------------------------


def _gateway_graph() -> dict[str, set[str]]:
    return import_graph({module_name(p): s for p, s in sources("gateway").items()})


def test_the_gateway_imports_no_node_engine_or_role() -> None:
    banned = {"node", "engine", "prefill", "decode", "kvtransfer", "torch", "duet", "bench"}
    for f in py_files("gateway"):
        bad = {top(m) for m in imports(f)} & banned
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_gateway_imports_follow_its_layers() -> None:
    assert upward_imports(_gateway_graph()) == []


def test_the_gateway_has_no_import_cycle() -> None:
    assert import_cycles(_gateway_graph()) == []


def test_the_gateway_top_holds_its_root_and_config_and_no_file_is_long() -> None:
    top_level = sorted(p.name for p in (ROOT / "gateway").glob("*.py"))
    assert len(top_level) <= GATEWAY_TOP_MAX, top_level
    assert oversized(sources("gateway")) == []


def test_request_path_functions_are_short_and_narrow() -> None:
    modules = {rel: (ROOT / rel).read_text() for rel in REQUEST_PATH}
    assert long_or_wide(modules, REQUEST_PATH_EXCEPTIONS) == []


def test_no_public_function_speaks_dict_any() -> None:
    modules = {**sources("gateway", "node", "decode", "prefill")}
    modules.update({rel: (ROOT / rel).read_text() for rel in REQUEST_PATH})
    assert dict_any_offenders(modules, DICT_ANY_EXEMPT) == []


def test_roles_reach_node_only_through_its_role_api() -> None:
    allowed = {"node.legs", "node.engine_api"}
    for role in ("prefill", "decode"):
        for f in py_files(role):
            bad = {m for m in imports(f) if top(m) == "node" and m not in allowed}
            assert not bad, (
                f"{f.relative_to(ROOT)} imports {sorted(bad)} (only {sorted(allowed)} of node/)"
            )


def test_bench_talks_http_except_the_component_benchmarks() -> None:
    ours = {"engine", "kvtransfer", "coordinator", "gateway", "node", "prefill", "decode"}
    for f in py_files("bench"):
        rel = f.relative_to(ROOT).as_posix()
        used = {top(m) for m in imports(f)} & (ours | {"duet", "sim"})
        allowed = COMPONENT_BENCHMARKS.get(rel, set())
        assert used <= allowed, (
            f"{rel} imports {sorted(used - allowed)} (bench/ talks HTTP; component "
            f"benchmarks are listed in COMPONENT_BENCHMARKS)"
        )


def test_the_lists_name_real_files() -> None:
    for rel in [*REQUEST_PATH, *COMPONENT_BENCHMARKS]:
        assert (ROOT / rel).is_file(), rel
    for rel in DICT_ANY_EXEMPT:
        assert (ROOT / rel).exists(), rel
    for key in REQUEST_PATH_EXCEPTIONS:
        assert (ROOT / key.split("::")[0]).is_file(), key


# -- each rule catches a planted violation ---------------------------------------------------


def test_planted_upward_import_and_cycle_are_caught() -> None:
    graph = import_graph(
        {
            "gateway.accounts.ledger": "from gateway.serving.pipeline import run\n",
            "gateway.serving.pipeline": "from gateway.serving.attempts import Tries\n",
            "gateway.serving.attempts": "def f() -> None:\n    import gateway.serving.pipeline\n",
        }
    )
    assert upward_imports(graph) == [
        "gateway.accounts.ledger imports gateway.serving.pipeline (a layer above)"
    ]
    assert import_cycles(graph) == [["gateway.serving.attempts", "gateway.serving.pipeline"]]


def test_a_planted_long_or_wide_function_is_caught() -> None:
    wide = "def f(a, b, c, d, e, f, g):\n    pass\n"
    long = "class C:\n    async def run(self):\n" + "        x = 1\n" * 60
    private = "def _f(a, b, c, d, e, f, g):\n    pass\n"
    found = long_or_wide({"w.py": wide, "l.py": long, "p.py": private}, {})
    assert found == ["w.py:1 f (2 lines, 7 parameters)", "l.py:2 C.run (61 lines, 0 parameters)"]
    assert long_or_wide({"w.py": wide}, {"w.py::f": "a planted exception"}) == []


def test_a_planted_dict_any_signature_is_caught() -> None:
    src = "from typing import Any\n\ndef parse(raw: bytes) -> dict[str, Any]:\n    return {}\n"
    assert dict_any_offenders({"gateway/serving/x.py": src}, {}) == ["gateway/serving/x.py:3 parse"]
    assert dict_any_offenders({"gateway/tools/x.py": src}, {"gateway/tools/": "planted"}) == []


def test_planted_size_violations_are_caught() -> None:
    assert oversized({"gateway/big.py": "x = 1\n" * 401}) == ["gateway/big.py (401 lines)"]
    assert oversized({"gateway/ok.py": "x = 1\n" * 400}) == []
