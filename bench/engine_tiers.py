"""`python -m bench.engine_tiers`: the engine's quantization tiers on three workloads
(W1 prefill, W2 single-stream decode, W3 batch), side by side, measured in one run on this
machine.

- W1: prefill of one 512-token prompt (prompt tokens/s, median of repeats after a warm-up); the
  schemes' prefills are interleaved, one of each in turn, so the machine's drift moves them alike;
- W2: single-stream decode of 128 tokens after a 256-token prompt (decode tokens/s: tokens after
  the first over the time from the first to the last), with its memory roofline: each token reads
  every weight once, so the machine's streaming read bandwidth (measured in the same run, at the
  same threads) over the bytes a step reads is a ceiling no kernel passes, and "of roofline" says
  how close each scheme gets (an absolute tokens/s figure is a property of the host as much as of
  the engine);
- W3: 32 prompts x 256 tokens -> 128 tokens each, submitted together (output tokens/s, prefill
  included).

The CPU's kind (AVX2 / AVX-512 / AVX-512 BF16 / AMX: which kernel paths ran) is recorded beside
the figures. `--peers transformers,vllm,llama.cpp` runs bench.peers after duet in the same run
(each peer in its own process and environment; an absent one is said so) and gives, per
workload, duet's best scheme over the best peer.

Each scheme gets its own in-process EngineCore (same activation dtype, KV pool, prompts from
the same seed), all loaded at the start (W1 and W2 run them in turn, round after round; W3 one
scheme after another). Reported beside the figures: each scheme's ratio to bf16 ("none") in the same
run, the targets (RATIO_TARGETS, ABS_TARGETS), the process CPU time of each workload, and the
machine's load (other work on the machine skews wall-clock figures; ratios within one run are what
to compare). Progress on stderr; a table, or one JSON object with --json, on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

from bench import engine_runs
from bench.flops import ModelShape, machine_info, read_bandwidth_gbps
from bench.workload import random_prompt

SCHEMES = ("none", "int8", "int4", "int8-w8a8", "int4-w4a8")
#: the tiers' targets: (workload, scheme) -> minimum ratio to bf16 in the same run, or tokens/s
RATIO_TARGETS = {("W1", "int8-w8a8"): 1.5, ("W3", "int8-w8a8"): 1.3}
ABS_TARGETS = {("W2", "int8"): 150.0, ("W2", "int4"): 180.0, ("W1", "int8-w8a8"): 2400.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine_tiers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="model name or directory (default: %(default)s)",
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation/KV dtype"
    )
    p.add_argument(
        "--schemes", default=",".join(SCHEMES), help="comma-separated (default: %(default)s)"
    )
    p.add_argument("--workloads", default="W1,W2,W3", help="comma-separated subset of W1,W2,W3")
    p.add_argument(
        "--threads", type=int, default=None, help="torch/OpenMP threads (default: all cores)"
    )
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prefill-reps", type=int, default=5)
    p.add_argument("--w2-context", type=int, default=256)
    p.add_argument("--w2-tokens", type=int, default=128)
    p.add_argument(
        "--w2-reps", type=int, default=3, help="W2 rounds, one run of every scheme each (median)"
    )
    p.add_argument("--w3-batch", type=int, default=32)
    p.add_argument("--w3-input", type=int, default=256)
    p.add_argument("--w3-output", type=int, default=128)
    p.add_argument(
        "--peers",
        default="",
        help="peers to run in the same run after duet (bench.peers: transformers,vllm,llama.cpp); "
        "the table then gives duet's best scheme over the best peer per workload (default: none)",
    )
    p.add_argument("--vllm-python", default=None, help="bench.peers' --vllm-python")
    p.add_argument("--llama-python", default=None, help="bench.peers' --llama-python")
    p.add_argument("--gguf", default=None, help="bench.peers' --gguf (llama.cpp's model)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _engine(args: argparse.Namespace, scheme: str):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    per_seq = (max(args.w3_input, args.w2_context) + max(args.w3_output, args.w2_tokens)) // 16 + 4
    blocks = max(args.w3_batch * per_seq, 2 * args.prefill_len // 16) + 16
    return EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            threads=args.threads,
            max_num_seqs=args.w3_batch,
            max_num_batched_tokens=max(2048, args.prefill_len),
            enable_prefix_caching=False,
            num_kv_blocks=blocks,
            max_model_len=1024,
            quantization=engine_runs.quantization(scheme),
        )
    )


def single_stream(
    eng, shape: ModelShape, context: int, tokens: int, rng: random.Random
) -> dict[str, Any]:
    """One request: decode tokens/s from its first token to its last (prefill excluded)."""
    stamps: list[float] = []

    def on_token(rid: str, finished: bool, now: float) -> None:
        stamps.append(now)

    eng.add_request("w2", random_prompt(rng, context, shape.vocab), engine_runs._greedy(tokens))
    engine_runs._drain(eng, on_token)
    return {
        "context": context,
        "tokens": tokens,
        "tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
    }


def roofline(r: dict[str, Any], eng, read_gbps: float) -> None:
    """W2's memory roofline: single-stream decode reads every weight once per token (plus the
    sequence's KV), so `read_gbps` over those bytes bounds its tokens/s on this machine whatever
    the kernels do. Adds the bytes, the ceiling and the fraction of it reached."""
    layout = eng.runner.kv_layout  # KV bytes per token as bench.profile counts them
    kv = (r["context"] + r["tokens"] / 2) * (layout.block_bytes // layout.block_size)
    r["weight_bytes_per_token"] = eng.runner.model.decode_weight_bytes()
    r["kv_bytes_per_token"] = int(kv)
    r["read_gbps"] = read_gbps
    r["roofline_tokens_per_s"] = read_gbps * 1e9 / (r["weight_bytes_per_token"] + kv)
    r["of_roofline"] = r["tokens_per_s"] / r["roofline_tokens_per_s"]


def _timed(fn, *a) -> dict[str, Any]:
    c0 = time.process_time()
    r = fn(*a)
    r["cpu_s"] = time.process_time() - c0
    return r


def _per_cpu_s(r: dict[str, Any], tokens: int) -> None:
    """Tokens per second of this process's CPU time (all threads): a busy machine moves it much
    less than wall-clock rates (warm-ups included where the workload has them)."""
    r["tokens_per_cpu_s"] = tokens / r["cpu_s"]


def _rounds(
    engines: dict[str, Any], reps: int, warm, once
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """`warm(scheme, eng)` once per scheme, then `reps` rounds of `once(scheme, eng, rep)`, one
    scheme after another within a round, so the machine's speed, which drifts by tens of percent
    over minutes on a shared VM, moves every scheme alike and the ratios stay honest. Returns
    each scheme's values in order and the process CPU time of its timed calls."""
    values: dict[str, list[float]] = {s: [] for s in engines}
    cpu = dict.fromkeys(engines, 0.0)
    for s, eng in engines.items():
        warm(s, eng)
    for rep in range(reps):
        for s, eng in engines.items():
            c0 = time.process_time()
            values[s].append(once(s, eng, rep))
            cpu[s] += time.process_time() - c0
    return values, cpu


def _w1_interleaved(
    engines: dict[str, Any], args: argparse.Namespace, progress
) -> dict[str, dict[str, Any]]:
    """W1 for every scheme in rounds (`_rounds`, after one warm-up each). Per scheme:
    engine_runs.prefill's figures plus the CPU time of its timed prefills."""
    shape = ModelShape.of(next(iter(engines.values())).model_config)
    rngs = {s: random.Random(args.seed) for s in engines}
    times, cpu = _rounds(
        engines,
        args.prefill_reps,
        lambda s, eng: engine_runs.prefill_once(eng, shape, args.prefill_len, rngs[s], "w1-warm"),
        lambda s, eng, rep: engine_runs.prefill_once(
            eng, shape, args.prefill_len, rngs[s], f"w1-{rep}"
        ),
    )
    out = {}
    for s in engines:
        r = out[s] = engine_runs.prefill_result(shape, args.prefill_len, times[s])
        r["cpu_s"] = cpu[s]
        _per_cpu_s(r, args.prefill_len * args.prefill_reps)
        r["interleaved"] = True
        progress(
            f"{s}: W1 prefill {r['tokens_per_s']:.0f} tokens/s (interleaved with the other schemes)"
        )
    return out


def _w2_interleaved(
    engines: dict[str, Any], args: argparse.Namespace, progress
) -> tuple[dict[str, dict[str, Any]], float]:
    """W2 for every scheme, one single-stream decode of each in turn per round (after a short
    warm-up each), for the same reason as W1: the ratios must not carry the machine's drift
    between schemes. Per scheme: the median decode tokens/s of its rounds, their spread, the CPU
    time of its timed runs and the memory roofline (bandwidth measured just before)."""
    shape = ModelShape.of(next(iter(engines.values())).model_config)
    rngs = {s: random.Random(args.seed + 1) for s in engines}
    read_gbps = read_bandwidth_gbps()
    progress(f"memory read bandwidth {read_gbps:.1f} GB/s")
    rates, cpu = _rounds(
        engines,
        args.w2_reps,
        lambda s, eng: single_stream(eng, shape, 32, 8, rngs[s]),
        lambda s, eng, rep: single_stream(eng, shape, args.w2_context, args.w2_tokens, rngs[s])[
            "tokens_per_s"
        ],
    )
    out = {}
    for s, eng in engines.items():
        ordered = sorted(rates[s])
        r = out[s] = {
            "context": args.w2_context,
            "tokens": args.w2_tokens,
            "repeats": args.w2_reps,
            "tokens_per_s": ordered[len(ordered) // 2],
            "tokens_per_s_min": ordered[0],
            "tokens_per_s_max": ordered[-1],
            "cpu_s": cpu[s],
            "interleaved": True,
        }
        _per_cpu_s(r, args.w2_tokens * args.w2_reps)
        roofline(r, eng, read_gbps)
        progress(
            f"{s}: W2 single stream {r['tokens_per_s']:.1f} tokens/s ({r['of_roofline']:.0%} of "
            f"the {r['roofline_tokens_per_s']:.0f} memory bandwidth allows; interleaved)"
        )
    return out, read_gbps


def run(args: argparse.Namespace, progress) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    work = [w.strip() for w in args.workloads.split(",") if w.strip()]
    from engine.cpu import cpu_kind
    from engine.kernels import kernels_lib

    lib = kernels_lib()
    result: dict[str, Any] = {
        "machine": {
            **machine_info(torch.get_num_threads()),
            "cpu_kind": cpu_kind(),
            "kernels_isa": None if lib is None else int(lib.kernels_isa()),
        },
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "schemes": {},
    }
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    engines = {}
    for scheme in schemes:
        progress(f"{scheme}: loading")
        engines[scheme] = _engine(args, scheme)
    w1 = _w1_interleaved(engines, args, progress) if "W1" in work else {}
    w2: dict[str, Any] = {}
    if "W2" in work:
        w2, read_gbps = _w2_interleaved(engines, args, progress)
        result["machine"]["read_gbps"] = round(read_gbps, 2)
    for scheme in schemes:
        eng = engines.pop(scheme)
        shape = ModelShape.of(eng.model_config)
        rng = random.Random(args.seed + 1)
        row: dict[str, Any] = {}
        if "W1" in work:
            row["W1"] = w1[scheme]
        if "W2" in work:
            row["W2"] = w2[scheme]
        if "W3" in work:
            r = row["W3"] = _timed(
                engine_runs.end_to_end,
                eng,
                shape,
                args.w3_batch,
                args.w3_input,
                args.w3_output,
                rng,
            )
            r["tokens_per_s"] = r["output_tokens_per_s"]
            _per_cpu_s(r, args.w3_batch * args.w3_output)
            progress(f"{scheme}: W3 batch {r['tokens_per_s']:.0f} output tokens/s")
        result["schemes"][scheme] = row
        del eng
    base = result["schemes"].get("none")
    targets = []
    for scheme, row in result["schemes"].items():
        for w, r in row.items():
            if base is not None and w in base:
                r["vs_bf16"] = r["tokens_per_s"] / base[w]["tokens_per_s"]
                r["vs_bf16_cpu"] = r["tokens_per_cpu_s"] / base[w]["tokens_per_cpu_s"]
                if scheme != "none":
                    targets.append(
                        {
                            "workload": w,
                            "scheme": scheme,
                            "what": ">= bf16",
                            "met": r["vs_bf16"] >= 1.0,
                        }
                    )
            if (w, scheme) in RATIO_TARGETS and "vs_bf16" in r:
                t = RATIO_TARGETS[(w, scheme)]
                targets.append(
                    {
                        "workload": w,
                        "scheme": scheme,
                        "what": f">= {t}x bf16",
                        "met": r["vs_bf16"] >= t,
                    }
                )
            if (w, scheme) in ABS_TARGETS:
                t = ABS_TARGETS[(w, scheme)]
                targets.append(
                    {
                        "workload": w,
                        "scheme": scheme,
                        "what": f">= {t:.0f} tokens/s",
                        "met": r["tokens_per_s"] >= t,
                    }
                )
    result["targets"] = targets
    if args.peers:
        from bench import peers

        result["peers"] = peers.for_tiers(args, progress)
        peers.against(result)
    result["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return result


def table(result: dict[str, Any]) -> str:
    work = [w for w in ("W1", "W2", "W3") if any(w in r for r in result["schemes"].values())]
    head = [
        "scheme",
        *[f"{w} tok/s" for w in work],
        *[f"{w} vs bf16" for w in work],
        *[f"{w} tok/cpu-s" for w in work],
        *[f"{w} cpu vs bf16" for w in work],
        *(["W2 MB/token", "W2 of roofline"] if "W2" in work else []),
    ]
    rows = []
    for s, r in result["schemes"].items():
        bw = r.get("W2", {})  # the bandwidth figures, when W2 ran
        rows.append(
            [
                s,
                *[f"{r[w]['tokens_per_s']:.1f}" if w in r else "-" for w in work],
                *[f"{r[w]['vs_bf16']:.2f}x" if w in r and "vs_bf16" in r[w] else "-" for w in work],
                *[f"{r[w]['tokens_per_cpu_s']:.1f}" if w in r else "-" for w in work],
                *[
                    f"{r[w]['vs_bf16_cpu']:.2f}x" if w in r and "vs_bf16_cpu" in r[w] else "-"
                    for w in work
                ],
                *(
                    [
                        f"{(bw['weight_bytes_per_token'] + bw['kv_bytes_per_token']) / 1e6:.0f}",
                        f"{r['W2']['of_roofline']:.0%}",
                    ]
                    if "W2" in r
                    else ["-", "-"]
                    if "W2" in work
                    else []
                ),
            ]
        )
    widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(x, widths, strict=True)) for x in rows]
    for t in result["targets"]:
        lines.append(
            f"target {t['workload']} {t['scheme']} {t['what']}: {'met' if t['met'] else 'MISSED'}"
        )
    if "peers" in result:
        from bench.peers import table as peers_table

        lines.append(peers_table(result["peers"]))
        for w, v in result.get("vs_peers", {}).items():
            lines.append(
                f"{w}: duet {v['duet']} {v['duet_tokens_per_s']:.1f} tok/s = {v['ratio']:.2f}x the "
                f"best peer ({v['peer']} {v['peer_tokens_per_s']:.1f})"
            )
    m = result["machine"]
    bw = (
        f", memory read {m['read_gbps']} GB/s (W2's roofline: that over MB/token)"
        if "read_gbps" in m
        else ""
    )
    lines.append(
        f"{m['cpu']} ({m.get('cpu_kind')}), {m['threads']} threads{bw}, load average at the start "
        f"{m.get('load_avg_1m_at_start')}, at the end {m.get('load_avg_1m_at_end')}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def progress(msg: str) -> None:
        print(
            f"[bench.engine_tiers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True
        )

    result = run(args, progress)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
