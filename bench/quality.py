"""`python -m bench.quality`: what weight-only quantization and the 8-bit KV cache cost in
quality.

For the model in bf16 and each quantization scheme (same activation dtype, same engine):
- perplexity on an English corpus that is already on every machine running duet: the module
  docstrings of a fixed list of Python standard-library modules (prose documentation written by
  the CPython developers; stable for a given Python version, which the report records with the
  corpus's sha256), tokenized with the model's tokenizer and cut to `--tokens` tokens, scored in
  non-overlapping windows of `--window` tokens (every token after a window's first is predicted);
- greedy agreement with bf16 over `--prompts` prompts (windows of the same corpus): first tokens
  equal, tokens before the first divergence, and sequences identical in full.
- perplexity on a second corpus the model has never seen (so a scheme tuned on the first is
  judged on text it was not tuned on): an English passage written for this project
  (bench/data/passage_en.txt: plain narrative prose, no code), scored the same way; a scheme
  meets its target only when it does on both corpora.
Targets: int8 and int8-w8a8 perplexity within 1% of bf16, int4 within 6%.

The scheme `kv-int8` keeps the weights and stores the KV pool in int8 (`--kv-cache-dtype int8`,
engine/kv_quant.py); its target is +0.5%. A window scored in one pass attends to its own
unquantized K/V, so score it in chunks (`--chunk 16`): every chunk after a window's first then
reads its keys and values back from the pool, as decoding does. Greedy agreement also reports
`positions_equal`, the share of positions whose tokens are equal, diverged or not.

The logits come straight from the engine's forward pass over its paged KV pool (the code
serving uses), one window per pass; generation goes through the offline LLM API. Progress on
stderr; a table, or one JSON object with --json, on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

#: prose-heavy stdlib module docstrings, in this order
CORPUS_MODULES = (
    "argparse",
    "csv",
    "json",
    "socket",
    "subprocess",
    "tempfile",
    "timeit",
    "unittest",
    "urllib.request",
    "uuid",
    "pydoc",
    "doctest",
    "ftplib",
    "smtplib",
    "difflib",
    "os",
    "inspect",
    "random",
    "sqlite3",
    "wave",
    "turtle",
    "getopt",
    "optparse",
    "trace",
    "itertools",
    "collections",
    "typing",
)
TARGETS = {
    "int8": 0.01,
    "int4": 0.06,
    "int4-g64": 0.06,
    "int8-w8a8": 0.01,
    "int4-w4a8": 0.06,
    "kv-int8": 0.005,
}  # max increase
#: schemes of the KV pool, not the weights: name → --kv-cache-dtype
KV_SCHEMES = {"kv-int8": "int8"}
PASSAGE = Path(__file__).parent / "data" / "passage_en.txt"


def corpus_text() -> str:
    docs = []
    for name in CORPUS_MODULES:
        doc = (importlib.import_module(name).__doc__ or "").strip()
        if doc:
            docs.append(doc)
    return "\n\n".join(docs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="model name or directory (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="activation dtype of every run, and the weights' dtype of the baseline (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--schemes",
        default="int8,int4,int4-g64,int8-w8a8,int4-w4a8",
        help="comma-separated schemes to compare (default: %(default)s)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="tokens per forward pass within a scoring window; later chunks read the KV pool "
        "(default: the whole window in one pass)",
    )
    p.add_argument(
        "--tokens", type=int, default=4096, help="corpus tokens scored (default: %(default)s)"
    )
    p.add_argument(
        "--window", type=int, default=512, help="tokens per scoring window (default: %(default)s)"
    )
    p.add_argument(
        "--prompts", type=int, default=64, help="greedy-agreement prompts (default: %(default)s)"
    )
    p.add_argument(
        "--prompt-len", type=int, default=48, help="tokens per prompt (default: %(default)s)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=32, help="greedy tokens per prompt (default: %(default)s)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch/OpenMP threads (default: all cores)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args(argv)


def _llm(args: argparse.Namespace, scheme: str | None):
    from engine import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        quantization=None if scheme in KV_SCHEMES else scheme,
        kv_cache_dtype=KV_SCHEMES.get(scheme or "", "auto"),
        threads=args.threads,
        max_model_len=max(args.window, args.prompt_len + args.max_tokens) + 16,
        num_kv_blocks=max(
            args.window // 16 + 2, args.prompts * ((args.prompt_len + args.max_tokens) // 16 + 2)
        ),
        max_num_seqs=args.prompts,
        enable_prefix_caching=False,
    )


def perplexity(llm, ids: list[int], window: int, chunk: int = 0) -> dict[str, Any]:
    """exp(mean NLL) of every token after the first of each non-overlapping window, each window
    computed in passes of `chunk` tokens (0: one pass)."""
    import torch

    from engine.attention import build_metadata

    runner = llm.engine.runner
    blocks = list(range((window + runner.block_size - 1) // runner.block_size))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        win = ids[start : start + window]
        if len(win) < 2:
            break
        parts = []
        step = chunk or len(win)
        for at in range(0, len(win), step):
            n = min(step, len(win) - at)
            md = build_metadata(
                runner.block_size, [], [(blocks, at, n)], runner.cfg.sliding_window, runner.device
            )
            parts.append(
                runner.model.forward(
                    torch.tensor(win[at : at + n]), runner.kv_cache, md, torch.arange(n)
                )
            )
        logp = torch.log_softmax(torch.cat(parts)[:-1].float(), dim=-1)
        target = torch.tensor(win[1:])
        nll -= logp.gather(1, target[:, None]).sum().item()
        count += len(win) - 1
    return {"perplexity": math.exp(nll / count), "scored_tokens": count}


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine import SamplingParams

    outs = llm.generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    return [o.token_ids for o in outs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    prefix = [
        next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
        for r, g in zip(ref, got, strict=True)
    ]
    n = len(ref)
    same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    return {
        "first_token": sum(r[0] == g[0] for r, g in zip(ref, got, strict=True)) / n,
        "positions_equal": same / sum(len(r) for r in ref),
        "tokens_before_divergence": sum(prefix) / sum(len(r) for r in ref),
        "identical_sequences": sum(p == len(r) for p, r in zip(prefix, ref, strict=True)) / n,
    }


def run(args: argparse.Namespace, progress) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    text = corpus_text()
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    result: dict[str, Any] = {
        "config": {
            "model": args.model,
            "dtype": args.dtype,
            "window": args.window,
            "chunk": args.chunk,
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
        },
        "corpus": {
            "source": "module docstrings of Python's standard library",
            "modules": list(CORPUS_MODULES),
            "python": platform.python_version(),
            "chars": len(text),
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
        },
        "schemes": {},
    }
    passage = PASSAGE.read_text()
    result["passage"] = {
        "source": str(PASSAGE.relative_to(Path(__file__).parent.parent)),
        "chars": len(passage),
        "sha256": hashlib.sha256(passage.encode()).hexdigest(),
    }
    ref_tokens: list[list[int]] | None = None
    ids: list[int] = []
    passage_ids: list[int] = []
    prompts: list[list[int]] = []
    for scheme in [None, *schemes]:
        name = scheme or ("bf16" if args.dtype == "bfloat16" else args.dtype)
        progress(f"{name}: loading")
        llm = _llm(args, scheme)
        if not ids:
            ids = llm.tokenizer.encode(text)[: args.tokens]
            if len(ids) < args.tokens:
                progress(f"the corpus has only {len(ids)} tokens; scoring those")
            stride = max(1, (len(ids) - args.prompt_len) // args.prompts)
            prompts = [ids[i * stride : i * stride + args.prompt_len] for i in range(args.prompts)]
            result["corpus"]["tokens"] = len(ids)
            passage_ids = llm.tokenizer.encode(passage)
            result["passage"]["tokens"] = len(passage_ids)
        t0 = time.perf_counter()
        progress(f"{name}: perplexity over {len(ids)} tokens")
        row: dict[str, Any] = perplexity(llm, ids, args.window, args.chunk)
        row["passage"] = perplexity(llm, passage_ids, args.window, args.chunk)
        progress(f"{name}: perplexity {row['perplexity']:.4f}; greedy over {len(prompts)} prompts")
        tokens = greedy(llm, prompts, args.max_tokens)
        if ref_tokens is None:
            ref_tokens = tokens
        else:
            row["greedy_agreement"] = agreement(ref_tokens, tokens)
        row["seconds"] = time.perf_counter() - t0
        result["schemes"][name] = row
        del llm
    first = next(iter(result["schemes"].values()))
    base, base_p = first["perplexity"], first["passage"]["perplexity"]
    for name, row in result["schemes"].items():
        row["perplexity_vs_baseline"] = row["perplexity"] / base - 1
        row["passage"]["perplexity_vs_baseline"] = row["passage"]["perplexity"] / base_p - 1
        if name in TARGETS:
            worst = max(row["perplexity_vs_baseline"], row["passage"]["perplexity_vs_baseline"])
            row["target"] = {"max_increase": TARGETS[name], "met": worst <= TARGETS[name]}
    return result


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'scheme':>9}  {'perplexity':>10}  {'vs base':>8}  {'passage':>8}  {'vs base':>8}  "
        f"{'first tok':>9}  {'agree':>6}  {'same seq':>8}  target"
    ]
    for name, r in result["schemes"].items():
        a = r.get("greedy_agreement")
        agree = (
            f"{a['first_token']:>9.3f}  {a['tokens_before_divergence']:>6.3f}  "
            f"{a['identical_sequences']:>8.3f}"
            if a
            else f"{'-':>9}  {'-':>6}  {'-':>8}"
        )
        target = (
            ""
            if "target" not in r
            else f"<= +{100 * r['target']['max_increase']:.0f}%: "
            + ("met" if r["target"]["met"] else "MISSED")
        )
        pp = r["passage"]
        lines.append(
            f"{name:>9}  {r['perplexity']:>10.4f}  {100 * r['perplexity_vs_baseline']:>+7.2f}%  "
            f"{pp['perplexity']:>8.3f}  {100 * pp['perplexity_vs_baseline']:>+7.2f}%  {agree}  "
            f"{target}"
        )
    c = result["corpus"]
    lines.append(
        f"corpus: {c['tokens']} tokens of {c['source']} (Python {c['python']}, sha256 "
        f"{c['sha256'][:12]})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def progress(msg: str) -> None:
        print(f"[bench.quality {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    result = run(args, progress)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
