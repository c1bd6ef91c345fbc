"""`duet up`: everything on this machine, under one supervisor.

Until the coordinator and gateway land, "everything" is one colocated node answering the
OpenAI-style `POST /v1/completions` on the public port (default 8000); with `--pd` a prefill
node and a decode node start beside it (ports +100 and +200) for trying disaggregation with
`duet bench pd`. The default model is pulled first if it is missing.
"""

from __future__ import annotations

import argparse
import sys

from protocol.models import DEFAULT_MODEL, REGISTRY, ModelNotFoundError, resolve_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="start duet on this machine (a node on :8000; see --help)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf file or HF directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="public port")
    p.add_argument("--pd", action="store_true", help="also start a prefill and a decode node")
    p.add_argument("--threads", type=int, default=None, help="torch threads per node")
    p.add_argument("--kv-memory", default="1GiB", help="KV pool per node")
    p.add_argument("--transport", default="nixl", choices=["nixl", "ucx", "tcp"])
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from duet.supervisor import Child, Supervisor

    try:
        resolve_model(args.model)
    except ModelNotFoundError:
        if args.model not in REGISTRY:
            raise
        from engine.pull import PullError, pull

        try:
            pull(args.model, progress=lambda m: print(m, file=sys.stderr, flush=True))
        except PullError as e:
            print(f"duet up: error: {e}", file=sys.stderr)
            return 1

    def node(role: str, port: int) -> Child:
        cmd = [sys.executable, "-m", "duet", "node", "--role", role, "--model", args.model,
               "--host", args.host, "--port", str(port), "--kv-memory", args.kv_memory,
               "--transport", args.transport]  # fmt: skip
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        return Child(f"{role} node :{port}", cmd, f"http://{args.host}:{port}/health")

    children = [node("both", args.port)]
    if args.pd:
        children += [node("prefill", args.port + 100), node("decode", args.port + 200)]
    print(f"duet up: serving {args.model} at http://{args.host}:{args.port}/v1/completions",
          file=sys.stderr)  # fmt: skip
    return Supervisor(children).run()
