"""`python -m bench.engine` (also `duet bench engine`): the native engine's throughput, and its
ratio to transformers on an online workload, measured in one run on this machine.

The one bench module that runs the engine in-process (the others talk HTTP): it measures the
engine itself. Progress goes to stderr; stdout gets a table, or one JSON object with --json.
Figures: prefill tokens/s for one prompt; single-stream decode tokens/s;
steady-state decode tokens/s with 8/32/64 running sequences (prefill excluded); end-to-end
output tokens/s at concurrency 1/8/32/64; an online workload (Poisson arrivals, seeded
long-tailed lengths) on the engine, on the same engine admitting static batches (the
ablation that separates continuous batching's share from the rest), and on transformers
`generate` with static batches of the same size, with the ratios; achieved model GFLOP/s as a
fraction of the GEMM peak of the engine's own linear path (oneDNN-prepacked for bf16) in the
dtype the engine runs, measured in the same run at the same thread count. Prefill and decode
are both medians (prefill over repeated prompts, decode over steps) with p10/p90 beside.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

from bench import engine_report, engine_runs
from bench.flops import ModelShape, gemm_peak_gflops, linear_peak_gflops, machine_info
from bench.workload import online_workload, summarize

DESCRIPTION = """\
Measure the native engine on this machine, in one run: prefill tokens/s for one prompt;
single-stream decode tokens/s; steady-state decode tokens/s with 8/32/64 sequences all
decoding (prefill excluded, context = the prompt length plus the timed steps); end-to-end
output tokens/s at concurrency 1/8/32/64 (prefill included); an online workload (Poisson
arrivals, seeded lognormal input/output lengths) on the engine (continuous batching), on the
same engine with static batches (the ablation: engine / engine-static is continuous
batching's share, engine-static / transformers the kernels' and the rest), and on
transformers `generate` (static batches of the same size, left padding, each request stopped
at its own length, in the engine's dtype), with the ratios; and model GFLOP/s (2 x weights
touched per token + attention) as a fraction of the GEMM peak of the engine's own linear
path (oneDNN-prepacked for bf16) in the engine's dtype, measured here at the same thread
count (plain torch.mm peaks beside it). Prefill and decode figures are medians with p10/p90.
Progress goes to stderr; the table (or --json) to stdout. A full run takes ~10-15 minutes on 2
cores, mostly the baselines."""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--quick shrinks every size (about 1-2 minutes on 2 cores); explicit size options "
        "override both presets. Wall-clock figures need a quiet machine: check the load.",
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="model name or directory (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="engine and transformers dtype; auto: bf16 where the CPU has native bf16 GEMM",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch/OpenMP threads (default: all cores)"
    )
    p.add_argument(
        "--quick", action="store_true", help="small sizes: a smoke test, not a measurement"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefill-len", type=int, help="prompt tokens of the prefill figure (default 512)"
    )
    p.add_argument(
        "--prefill-reps", type=int, help="timed prefills, median reported (default 9; quick 5)"
    )
    p.add_argument("--context", type=int, help="prompt tokens before decoding starts (default 256)")
    p.add_argument(
        "--decode-steps", type=int, help="timed decode steps per figure (default 32; quick 8)"
    )
    p.add_argument(
        "--batches", type=_ints, help="steady-state decode batch sizes (default 8,32,64)"
    )
    p.add_argument(
        "--concurrency", type=_ints, help="end-to-end concurrency levels (default 1,8,32,64)"
    )
    p.add_argument("--e2e-input", type=int, help="end-to-end prompt tokens (default 256)")
    p.add_argument(
        "--e2e-output", type=int, help="end-to-end output tokens (default 128; quick 16)"
    )
    p.add_argument(
        "--online-requests", type=int, help="online workload size (default 200; quick 24)"
    )
    p.add_argument("--online-rate", type=float, help="Poisson arrival rate, requests/s (default 8)")
    p.add_argument(
        "--online-batch",
        type=int,
        help="engine max running sequences = transformers static batch size (default 32; quick 8)",
    )
    p.add_argument(
        "--skip-transformers", action="store_true", help="online workload on the engine only"
    )
    p.add_argument(
        "--peak-size", type=int, help="matmul size of the GEMM peaks (default 2048; quick 1024)"
    )
    a = p.parse_args(argv)
    full = {
        "prefill_len": 512,
        "prefill_reps": 9,
        "context": 256,
        "decode_steps": 32,
        "batches": [8, 32, 64],
        "concurrency": [1, 8, 32, 64],
        "e2e_input": 256,
        "e2e_output": 128,
        "online_requests": 200,
        "online_rate": 8.0,
        "online_batch": 32,
        "peak_size": 2048,
    }
    quick = {
        **full,
        "prefill_len": 256,
        "prefill_reps": 5,
        "context": 128,
        "decode_steps": 8,
        "e2e_input": 128,
        "e2e_output": 16,
        "online_requests": 24,
        "online_batch": 8,
        "peak_size": 1024,
    }
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def _model_max_len(model: str) -> int:
    from engine.convert import ensure_converted
    from engine.model_config import ModelConfig
    from runtime.models import resolve_model

    return ModelConfig.from_dir(ensure_converted(resolve_model(model))).max_position_embeddings


def _engine(args: argparse.Namespace, max_num_seqs: int, kv_tokens: int):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    max_len = min(4096, _model_max_len(args.model))
    blocks = max(kv_tokens // 16 + max_num_seqs + 1, max_len // 16 + 1)
    return EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            threads=args.threads,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(2048, args.prefill_len),
            enable_prefix_caching=False,
            num_kv_blocks=blocks,
            max_model_len=max_len,
            block_size=16,
        )
    )


def run(args: argparse.Namespace, progress: engine_runs.Progress) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    result: dict[str, Any] = {"machine": machine_info(threads)}
    rng = random.Random(args.seed)

    big = max([*args.batches, *args.concurrency])
    need = big * (max(args.context, args.e2e_input) + max(args.decode_steps, args.e2e_output) + 16)
    eng = _engine(args, big, max(need, 4 * args.prefill_len))
    shape = ModelShape.of(eng.model_config)
    dtype = str(eng.dtype).removeprefix("torch.")
    result["config"] = {
        "model": eng.model_name,
        "dtype": dtype,
        "quick": args.quick,
        "seed": args.seed,
        "max_num_batched_tokens": eng.config.max_num_batched_tokens,
        "block_size": eng.config.block_size,
        "prefix_caching": False,
        "statistic": "median (prefill: over repeated prompts; decode: over steps), p10/p90 beside",
    }
    progress(
        f"GEMM peaks ({args.peak_size}^3, {threads} threads): the engine's linear path in {dtype}, "
        "torch.mm"
    )
    peak, path = linear_peak_gflops(eng.dtype, args.peak_size)
    peaks = {
        "dtype": dtype,
        "engine_linear": peak,
        "engine_linear_path": path,
        "torch_mm": {
            "bfloat16": gemm_peak_gflops(torch.bfloat16, args.peak_size),
            "float32": gemm_peak_gflops(torch.float32, args.peak_size),
        },
        "matmul_size": args.peak_size,
    }
    result["gemm_peak_gflops"] = peaks

    def frac(r: dict[str, Any]) -> dict[str, Any]:
        r["frac_peak"] = r["gflops"] / peaks["engine_linear"]
        return r

    r = result["prefill"] = frac(
        engine_runs.prefill(eng, shape, args.prefill_len, args.prefill_reps, rng)
    )
    progress(
        f"prefill, {args.prefill_len}-token prompt: {r['tokens_per_s']:.0f} tokens/s "
        f"(p10-p90 {r['tokens_per_s_p10']:.0f}-{r['tokens_per_s_p90']:.0f}), "
        f"{r['frac_peak']:.0%} of the {dtype} {path} peak"
    )
    r = result["decode_single"] = frac(
        engine_runs.steady_decode(eng, shape, 1, args.context, args.decode_steps, rng)
    )
    progress(f"single-stream decode at context {args.context}: {r['tokens_per_s']:.1f} tokens/s")
    result["decode_steady"] = []
    for b in args.batches:
        r = frac(engine_runs.steady_decode(eng, shape, b, args.context, args.decode_steps, rng))
        result["decode_steady"].append(r)
        progress(
            f"steady-state decode, {b} sequences at context {args.context}: "
            f"{r['tokens_per_s']:.0f} tokens/s"
        )
    result["end_to_end"] = []
    for c in args.concurrency:
        r = engine_runs.end_to_end(eng, shape, c, args.e2e_input, args.e2e_output, rng)
        result["end_to_end"].append(r)
        progress(
            f"end to end, concurrency {c}, {args.e2e_input} in / {args.e2e_output} out: "
            f"{r['output_tokens_per_s']:.0f} output tokens/s"
        )
    model_dir = eng.model_dir
    del eng

    items = online_workload(args.online_requests, args.online_rate, shape.vocab, seed=args.seed)
    online: dict[str, Any] = {
        "requests": len(items),
        "rate_per_s": args.online_rate,
        "batch": args.online_batch,
        "input_tokens": summarize([len(w.prompt) for w in items]),
        "output_tokens": summarize([w.output_len for w in items]),
    }
    worst = max(len(w.prompt) + w.output_len for w in items)
    eng = _engine(args, args.online_batch, args.online_batch * (worst + 16))
    progress(
        f"online workload on the engine: {len(items)} requests at {args.online_rate}/s, max "
        f"{args.online_batch} running"
    )
    online["engine"] = engine_runs.online_engine(eng, items, progress)
    progress(f"online, engine: {online['engine']['output_tokens_per_s']:.0f} output tokens/s")
    progress(
        f"online workload on the engine with static batches of up to {args.online_batch} (ablation)"
    )
    online["engine_static"] = engine_runs.online_engine_static(
        eng, items, args.online_batch, progress
    )
    tps = {k: online[k]["output_tokens_per_s"] for k in ("engine", "engine_static")}
    online["ratio_continuous_batching"] = tps["engine"] / tps["engine_static"]
    progress(
        f"online, engine with static batches: {tps['engine_static']:.0f} output tokens/s "
        f"(continuous / static {online['ratio_continuous_batching']:.2f}x)"
    )
    del eng
    if not args.skip_transformers:
        online["transformers"] = _online_transformers(args, model_dir, dtype, items, progress)
        tf = online["transformers"]["output_tokens_per_s"]
        online["ratio"] = tps["engine"] / tf
        online["ratio_engine_static_over_transformers"] = tps["engine_static"] / tf
        progress(
            f"online, transformers: {tf:.0f} output tokens/s (engine / transformers "
            f"{online['ratio']:.2f}x = continuous batching "
            f"{online['ratio_continuous_batching']:.2f}x x engine static / transformers "
            f"{online['ratio_engine_static_over_transformers']:.2f}x)"
        )
    result["online"] = online
    result["targets"] = engine_report.targets(result)
    # Other work on the machine skews every figure (OpenMP threads wait on a busy core): say so.
    result["machine"]["load_avg_1m_at_end"] = (
        round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    )
    return result


def _online_transformers(
    args: argparse.Namespace, model_dir, dtype: str, items, progress
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    # The baseline runs in the engine's dtype, or the ratio compares two different computations.
    got = {p.dtype for p in model.parameters()}
    if got != {getattr(torch, dtype)}:
        raise RuntimeError(
            f"transformers loaded the model as {sorted(map(str, got))}, the engine runs {dtype}"
        )
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad if isinstance(pad, int) else pad[0])
    # The engine runs with ignore_eos: lengths come from the workload, so no EOS stop here either.
    model.generation_config.eos_token_id = None
    with torch.inference_mode():  # warm-up: the first generate pays one-off setup
        model.generate(
            input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=pad
        )
    progress(
        f"online workload on transformers ({dtype}): static batches of up to {args.online_batch}"
    )
    r = engine_runs.online_transformers(model, items, args.online_batch, pad, progress)
    return {**r, "dtype": dtype}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def progress(msg: str) -> None:
        print(f"[bench.engine {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    result = run(args, progress)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(engine_report.table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
