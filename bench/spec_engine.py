"""`python -m bench.spec_engine`: speculative decoding measured in one run: the same
engine settings with `speculative` off and with `--method` (ngram, or a draft model such as
draft-int4: the target's own weights at int4 draft, the target verifies).

Workloads (`--workload`; default: edit for ngram, chat for the draft-model methods):
- chat: single-stream decode of `--tokens` (128: bench.engine_tiers' W2) answering an open question
  (a draft model pays on any text, not only copies);
- edit: edit a given text — the chat prompt asks the model to correct the spelling of a
passage (bench/data/passage_en.txt, a few words misspelt) and reproduce it, so the answer copies
long spans of the prompt, as summaries, edits and RAG answers do.
Figures (both engines are loaded side by side; the single-stream runs alternate between them,
`--repeats` each, and the median run of each is reported: the machine's load drifts):
- single stream: decode tokens/s (first token to last) and process CPU time per output token,
  greedy; the two outputs must be identical token for token (reported, and the exit status is 1
  when they differ);
- batch (default 32 requests of the same task with different passages' order, submitted
  together): output tokens/s with speculation on (it switches itself off above spec_max_batch)
  against off: its cost.
Reported with speculation: decode tokens per CPU-second off and on (the figure a loaded machine
moves least) and their ratio, and vLLM's spec-decode figures (drafts, draft tokens, accepted tokens,
acceptance rate, mean acceptance length). Progress on stderr; JSON (--json) or a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.flops import machine_info
from engine.spec_decode import METHODS, NUM_SPECULATIVE_TOKENS

PASSAGE = Path(__file__).parent / "data" / "passage_en.txt"
#: misspellings put into the passage for the model to fix (correct -> wrong)
TYPOS = {
    "morning": "mornig",
    "quay": "quey",
    "auction": "auktion",
    "winter": "wintre",
    "school": "scool",
    "change": "chnage",
    "families": "familys",
}


def edit_prompts(tokenizer, n: int) -> list[list[int]]:
    paras = [p.strip() for p in PASSAGE.read_text().split("\n\n") if p.strip()]
    out = []
    for i in range(n):
        text = paras[i % len(paras)]
        for right, wrong in TYPOS.items():
            text = text.replace(right, wrong)
        msg = (
            f"Correct the spelling mistakes in this text and write it out again in full:\n\n{text}"
        )
        out.append(tokenizer.encode_chat([{"role": "user", "content": msg}]))
    return out


CHAT = (
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle one winter "
    "morning, and what she does next."
)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": CHAT}])] * n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.spec_engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--quantization", default=None, help="engine quantization scheme (default: none)"
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--tokens", type=int, default=128, help="output tokens per request (default: %(default)s)"
    )
    p.add_argument(
        "--method",
        default="ngram",
        choices=METHODS,
        help="speculative method (default: %(default)s)",
    )
    p.add_argument(
        "--speculative-model", default=None, help="a separate draft model (draft-model methods)"
    )
    p.add_argument(
        "--workload",
        default=None,
        choices=["edit", "chat"],
        help="single-stream task (default: edit for ngram, chat for a draft model)",
    )
    p.add_argument(
        "--k",
        type=int,
        default=None,
        help="num_speculative_tokens (default: the engine's for the method: 5 ngram, 8 a draft "
        "model)",
    )
    p.add_argument("--batch", type=int, default=32, help="requests of the batch figure (0: skip)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="single-stream runs per engine, alternating (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.workload = args.workload or ("edit" if args.method == "ngram" else "chat")
    args.k = (
        args.k if args.k is not None else NUM_SPECULATIVE_TOKENS[args.method]
    )  # the engine's default
    return args


def _engine(args: argparse.Namespace, spec: bool):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    return EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            threads=args.threads,
            quantization=args.quantization,
            max_model_len=1024,
            num_kv_blocks=max(args.batch, 1) * (1024 // 16) + 16,
            max_num_seqs=max(args.batch, 1),
            enable_prefix_caching=False,
            speculative=args.method if spec else None,
            num_speculative_tokens=args.k,
            speculative_model=args.speculative_model if spec else None,
        )
    )


def _run(eng, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    out: dict[str, list[int]] = {}
    ids = []
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        rid = f"r{i}-{time.monotonic_ns()}"
        ids.append(rid)
        eng.add_request(rid, p, params)
    cpu_first = None
    while eng.has_unfinished():
        outs, _ = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in first:
                first[o.request_id] = now
                if len(first) == len(ids):
                    cpu_first = time.process_time()
            last[o.request_id] = now
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n_out = sum(len(out[r]) for r in ids)
    decode_s = max(last.values()) - max(first.values())
    return {
        "requests": len(ids),
        "output_tokens": n_out,
        "seconds": wall,
        "output_tokens_per_s": n_out / wall,
        "decode_tokens_per_s": (n_out - len(ids)) / decode_s if decode_s > 0 else None,
        "decode_cpu_ms_per_token": 1e3
        * (time.process_time() - (cpu_first or c0))
        / max(1, n_out - len(ids)),
        "decode_tokens_per_cpu_s": max(1, n_out - len(ids))
        / max(1e-9, time.process_time() - (cpu_first or c0)),
        "cpu_s": cpu,
        "token_ids": [out[r] for r in ids],
    }


def run(args: argparse.Namespace, progress) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "machine": machine_info(torch.get_num_threads()),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }
    # Both engines live side by side and their single-stream runs alternate (off, on, on, off,
    # ...): on a shared machine the load drifts, and a ratio of medians taken in turns moves less.
    names = ["off", args.method]
    engines = {}
    for name in names:
        progress(f"speculation {name}: loading")
        engines[name] = _engine(args, name != "off")
    tok = engines["off"].tokenizer
    prompts = edit_prompts(tok, max(args.batch, 1))
    single = prompts[:1] if args.workload == "edit" else chat_prompts(tok, 1)
    for eng in engines.values():
        _run(eng, [prompts[0][:64]], 4)  # warm-up
    base = dict(engines[args.method].stats())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            r = _run(engines[name], single, args.tokens)
            runs[name].append(r)
            progress(
                f"speculation {name}: single stream {r['decode_tokens_per_s']:.1f} decode "
                f"tokens/s, {r['decode_cpu_ms_per_token']:.1f} CPU ms/token"
            )
    for name in names:
        rs = sorted(runs[name], key=lambda r: r["decode_cpu_ms_per_token"])
        r = dict(rs[len(rs) // 2])  # the median run
        r["repeats_decode_tokens_per_cpu_s"] = [
            round(x["decode_tokens_per_cpu_s"], 2) for x in runs[name]
        ]
        r["all_identical"] = all(x["token_ids"] == runs["off"][0]["token_ids"] for x in runs[name])
        result[name] = {"single": r}
    st = engines[args.method].stats()
    result[args.method]["single"]["spec"] = {
        k: st[k] - base.get(k, 0) if "num" in k else st[k]
        for k in st
        if k.startswith("spec_decode") and "per_pos" not in k
    }
    if args.batch:
        for name in names:
            b = _run(engines[name], prompts, args.tokens)
            b.pop("token_ids")
            result[name]["batch"] = b
            progress(
                f"speculation {name}: batch of {args.batch}: {b['output_tokens_per_s']:.1f} output "
                f"tokens/s, {b['output_tokens'] / b['cpu_s']:.1f} per CPU-second"
            )
    del engines
    off, on = result["off"], result[args.method]
    result["greedy_identical"] = off["single"]["all_identical"] and on["single"]["all_identical"]
    result["single_speedup"] = (
        on["single"]["decode_tokens_per_s"] / off["single"]["decode_tokens_per_s"]
    )
    result["single_speedup_cpu"] = (
        off["single"]["decode_cpu_ms_per_token"] / on["single"]["decode_cpu_ms_per_token"]
    )
    if args.batch:
        result["batch_ratio"] = (
            on["batch"]["output_tokens_per_s"] / off["batch"]["output_tokens_per_s"]
        )
        result["batch_ratio_cpu"] = off["batch"]["cpu_s"] / on["batch"]["cpu_s"]
    for row in (off, on):
        row["single"]["token_ids"] = row["single"]["token_ids"][0][
            :16
        ]  # a sample, not the whole list
    result["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def progress(msg: str) -> None:
        print(f"[bench.spec_engine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    result = run(args, progress)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        s = result[args.method]["single"].get("spec", {})
        off, on = result["off"]["single"], result[args.method]["single"]
        print(
            f"{args.method}, {args.workload} workload, {args.tokens} tokens: decode tokens per "
            f"CPU-second {off['decode_tokens_per_cpu_s']:.1f} off, "
            f"{on['decode_tokens_per_cpu_s']:.1f} on (medians of "
            f"{off['repeats_decode_tokens_per_cpu_s']} and {on['repeats_decode_tokens_per_cpu_s']})"
        )
        print(
            f"single stream: x{result['single_speedup']:.2f} decode tokens/s (CPU "
            f"x{result['single_speedup_cpu']:.2f}), greedy identical: "
            f"{result['greedy_identical']}, acceptance rate "
            f"{s.get('spec_decode_acceptance_rate', 0):.2f}, mean acceptance length "
            f"{s.get('spec_decode_mean_acceptance_length', 0):.2f}"
        )
        if "batch_ratio" in result:
            print(
                f"batch of {args.batch}: x{result['batch_ratio']:.3f} output tokens/s (CPU "
                f"x{result['batch_ratio_cpu']:.3f})"
            )
    return 0 if result["greedy_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
