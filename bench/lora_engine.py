"""`python -m bench.lora_engine`: multi-LoRA's cost, measured in one run: a batch of `--batch` (32)
requests spread over `--adapters` (8) LoRA adapters of rank `--rank` (8) against the same batch
on the base model, output tokens/s, and their ratio.

Two engines of `--model` are loaded side by side: the baseline with LoRA off (`max_loras` 0: no
adapted linears at all, the honest base) and one with the adapters resident. The adapters are
random (seeded), written as PEFT directories under a temporary directory, targeting every
projection (q/k/v/o, gate/up/down): the most a LoRA step computes. Requests are distinct prompts
(`--prompt-tokens` each), `--tokens` output tokens each (ignore_eos), submitted together; prefix
caching is off so repeated rounds compute the same. Rounds alternate base and LoRA `--repeats`
times (the machine's load drifts) and the median round of each is reported, as output tokens per
wall second and per CPU second of the process (the figure a loaded machine moves least; with
`--threads 1` it is the compute alone). Progress on stderr; a table or JSON (--json) on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.flops import machine_info

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.lora_engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch", type=int, default=32, help="requests per round")
    p.add_argument("--adapters", type=int, default=8, help="adapters the LoRA round spreads over")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="rounds of each, alternating")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def write_adapters(cfg: Any, root: Path, n: int, rank: int) -> list[Path]:
    """`n` random PEFT adapter directories for a model of config `cfg` (engine ModelConfig)."""
    import torch
    from safetensors.torch import save_file

    from engine.lora.adapter import module_shapes

    shapes = module_shapes(cfg)
    out = []
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg.num_layers):
            for m in TARGETS:
                o, k = shapes[m]
                kind = "self_attn" if m[0] in "qkvo" else "mlp"
                key = f"base_model.model.model.layers.{layer}.{kind}.{m}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(o, rank, generator=gen) * 0.02
        d = root / f"adapter-{i}"
        d.mkdir(parents=True)
        save_file(tensors, str(d / "adapter_model.safetensors"))
        conf = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
        (d / "adapter_config.json").write_text(json.dumps(conf))
        out.append(d)
    return out


def one_round(
    llm: Any, prompts: list[list[int]], tokens: int, loras: list | None
) -> tuple[float, float]:
    """(output tokens per wall second, per CPU second of this process) of the whole batch,
    submitted together."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, lora_request=loras)
    n = sum(len(o.token_ids) for o in outs)
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from engine import LLM, LoRARequest

    blocks = args.batch * (-(-(args.prompt_tokens + args.tokens) // 16) + 1)
    common = dict(
        num_kv_blocks=max(blocks, 64),
        max_model_len=args.prompt_tokens + args.tokens + 16,
        dtype=args.dtype,
        threads=args.threads,
        enable_prefix_caching=False,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(512, args.batch * 8),
    )
    print(f"loading {args.model} twice (LoRA off / on)", file=sys.stderr)
    base = LLM(args.model, **common)
    lora = LLM(args.model, **common, max_loras=args.adapters, max_lora_rank=args.rank)
    rng = random.Random(0)
    vocab = base.engine.model_config.vocab_size
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)
    ]
    with tempfile.TemporaryDirectory(prefix="duet-lora-bench-") as tmp:
        dirs = write_adapters(base.engine.model_config, Path(tmp), args.adapters, args.rank)
        reqs = [LoRARequest(f"bench-{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
        for r in reqs:
            lora.load_lora(r)
        spread = [reqs[i % len(reqs)] for i in range(args.batch)]
        one_round(base, prompts[:4], 4, None)  # warm-up: first-call costs out of the rounds
        one_round(lora, prompts[:4], 4, spread[:4])
        rates: dict[str, list[tuple[float, float]]] = {"base": [], "lora": []}
        for i in range(args.repeats):
            rates["base"].append(one_round(base, prompts, args.tokens, None))
            rates["lora"].append(one_round(lora, prompts, args.tokens, spread))
            (bw, bc), (lw, lc) = rates["base"][-1], rates["lora"][-1]
            print(
                f"round {i + 1}: base {bw:.1f} tok/s ({bc:.1f} per CPU-s), "
                f"LoRA {lw:.1f} tok/s ({lc:.1f} per CPU-s)",
                file=sys.stderr,
            )
    b, lo = (statistics.median(r[0] for r in rates[k]) for k in ("base", "lora"))
    bc, lc = (statistics.median(r[1] for r in rates[k]) for k in ("base", "lora"))
    report = {
        "model": args.model,
        "dtype": base.engine.runner.kv_layout.dtype,
        "batch": args.batch,
        "adapters": args.adapters,
        "rank": args.rank,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.tokens,
        "base_tok_s": round(b, 1),
        "lora_tok_s": round(lo, 1),
        "ratio": round(lo / b, 3),
        "base_tok_per_cpu_s": round(bc, 1),
        "lora_tok_per_cpu_s": round(lc, 1),
        "cpu_ratio": round(lc / bc, 3),
        "rounds": rates,
        "machine": machine_info(torch.get_num_threads()),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{args.model} ({report['dtype']}): {args.batch} requests x {args.tokens} tokens — "
            f"base {b:.1f} tok/s, over {args.adapters} rank-{args.rank} adapters {lo:.1f} tok/s: "
            f"{lo / b:.3f}x; per CPU-second {bc:.1f} against {lc:.1f}: {lc / bc:.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
