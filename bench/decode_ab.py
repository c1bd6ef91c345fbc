"""`python -m bench.decode_ab`: whole-engine configurations (dtype, quantization, the bf16 linear
path) against each other, in one process, on decode steps and prefills.

Why one process: on a shared 2-vCPU VM the same engine's step time moves 10-15 % from one minute
to the next, so two runs minutes apart cannot tell a 10 % change from the machine. Here every
configuration gets its own in-process EngineCore, all loaded at the start, and the workloads run
them in rounds, one configuration after another (the order rotated each round), so drift moves
them alike. bench.kernel_ab does the same for two kernel builds on the linears alone.

A configuration is `DTYPE[/QUANT][:LINEAR][@KV]`: DTYPE fp32 or bf16; QUANT a --quantization
scheme (int8, int4, ...); LINEAR the bf16 linear path while that engine's weights are packed: `own`
(DUET_BF16_LINEAR=own: the project's GEMM, AVX2 too), `onednn` (DUET_BF16_LINEAR=onednn: oneDNN,
or F.linear where the CPU has no oneDNN bf16 reorder), or nothing (the default); KV the pool's
--kv-cache-dtype (`int8`; default the model's dtype), every pool the same number of blocks. The
first configuration is the baseline of the ratios.

Workloads:
- `decode B` (--batches): B sequences with --prompt-len-token prompts, all decoding; each round
  times --steps pure decode steps of each engine (the sequences live on across rounds, so every
  engine's context grows alike); the figure is the median step time over all rounds, and the
  tokens/s it gives (B per step);
- `prefill` (--prefill-len, 0: off): one fresh prompt per engine per round (the same prompt for
  every engine in a round), prompt in, first token out; median over rounds after a warm-up.

Clock: by default the process's CPU time (one thread: on a loaded machine it leaves out the time
the process waited for a core, which wall time does not); --clock wall for elapsed time. Prefix
caching is off. Progress on stderr; a table, or one JSON object with --json, on stdout.

Invariant: timing only; no figure here is compared against a bound in a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.flops import machine_info
from bench.workload import random_prompt

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}
_LINEARS = ("own", "onednn")
_KVS = ("auto", "int8")


@dataclass(frozen=True, kw_only=True)
class Config:
    """One engine configuration: its name as given, and what it sets."""

    name: str
    dtype: str
    quantization: str | None
    linear: str | None
    #: the pool's --kv-cache-dtype
    kv: str = "auto"


def parse_config(text: str) -> Config:
    """`bf16/int8:own@int8` -> Config; ValueError naming what is wrong."""
    text_kv, _, kv = text.partition("@")
    rest, _, linear = text_kv.partition(":")
    dtype, _, quant = rest.partition("/")
    if dtype not in _DTYPES:
        raise ValueError(f"{text!r}: dtype {dtype!r} is not one of fp32, bf16")
    if linear and linear not in _LINEARS:
        raise ValueError(f"{text!r}: linear path {linear!r} is not one of {', '.join(_LINEARS)}")
    if kv and kv not in _KVS:
        raise ValueError(f"{text!r}: KV dtype {kv!r} is not one of {', '.join(_KVS)}")
    return Config(
        name=text,
        dtype=_DTYPES[dtype],
        quantization=quant or None,
        linear=linear or None,
        kv=kv or "auto",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.decode_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model name or directory")
    ap.add_argument(
        "--configs",
        default="fp32,bf16,bf16:own",
        help="comma-separated DTYPE[/QUANT][:LINEAR][@KV] (default %(default)s); the first is the "
        "baseline",
    )
    ap.add_argument("--batches", default="1", help="decode batch sizes, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=256, help="decode prompts' tokens")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds over the configurations")
    ap.add_argument("--prefill-len", type=int, default=0, help="prefill prompt tokens (0: off)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    try:
        args.config_list = [parse_config(c.strip()) for c in args.configs.split(",") if c.strip()]
        args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError as e:
        ap.error(str(e))
    if not args.config_list:
        ap.error("--configs: at least one")
    if len({c.name for c in args.config_list}) != len(args.config_list):
        ap.error("--configs: each configuration once")
    if any(b < 1 for b in args.batch_list) or min(args.steps, args.rounds, args.prompt_len) < 1:
        ap.error("--batches, --steps, --rounds and --prompt-len must be at least 1")
    return args


def _clock(kind: str) -> Callable[[], float]:
    return time.process_time if kind == "cpu" else time.perf_counter


def build_engine(cfg: Config, args: argparse.Namespace, tokens: int):
    """An EngineCore for `cfg`, its linears packed under cfg's DUET_BF16_LINEAR (restored
    after: the choice is made when a layer is built)."""
    from engine.config import EngineConfig
    from engine.core import EngineCore

    batch = max(args.batch_list, default=1)
    blocks = batch * (-(-tokens // 16) + 1) + 8
    before = os.environ.get("DUET_BF16_LINEAR")
    if cfg.linear is None:
        os.environ.pop("DUET_BF16_LINEAR", None)
    else:
        os.environ["DUET_BF16_LINEAR"] = cfg.linear
    try:
        return EngineCore(
            EngineConfig(
                model=args.model,
                dtype=cfg.dtype,
                quantization=cfg.quantization,  # type: ignore[arg-type]
                kv_cache_dtype=cfg.kv,  # type: ignore[arg-type]
                threads=args.threads,
                num_kv_blocks=blocks,
                max_model_len=tokens,
                max_num_seqs=max(batch, 1),
                max_num_batched_tokens=max(512, args.prefill_len, batch),
                enable_prefix_caching=False,
                seed=args.seed,
            )
        )
    finally:
        if before is None:
            os.environ.pop("DUET_BF16_LINEAR", None)
        else:
            os.environ["DUET_BF16_LINEAR"] = before


def _greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _order(names: list[str], r: int) -> list[str]:
    """The round's order: rotated each round, so no configuration always runs first."""
    k = r % len(names)
    return names[k:] + names[:k]


def _prefill_steps(args: argparse.Namespace) -> int:
    """Steps the largest batch's prompts take to prefill (each step's token budget is
    build_engine's max_num_batched_tokens)."""
    batch = max(args.batch_list, default=1)
    budget = max(512, args.prefill_len, batch)
    return -(-batch * args.prompt_len // budget) + 1


def _decode_tokens(args: argparse.Namespace) -> int:
    """Tokens each decode sequence may generate: the timed steps and two warm ones, plus one a
    step while the others prefill (the first sequences decode meanwhile; sized without that, a
    sequence finished mid-round at 16 x 512-token prompts), and a margin."""
    return args.rounds * args.steps + 2 + _prefill_steps(args) + 8


def decode(engines: dict[str, Any], batch: int, args: argparse.Namespace, say) -> dict:
    """Seconds of each engine's timed decode steps at `batch` sequences, rounds alternated."""
    rng = random.Random(args.seed + batch)
    vocab = next(iter(engines.values())).model_config.vocab_size
    prompts = [random_prompt(rng, args.prompt_len, vocab) for _ in range(batch)]
    total = _decode_tokens(args)
    for eng in engines.values():
        for i, p in enumerate(prompts):
            eng.add_request(f"d{batch}-{i}", p, _greedy(total))
        reqs = [eng.request(f"d{batch}-{i}") for i in range(batch)]
        while any(not r.output_token_ids for r in reqs):
            eng.step()
        eng.step()  # the first all-decode step: warm
    clock = _clock(args.clock)
    times: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(args.rounds):
        for name in _order(list(engines), r):
            eng = engines[name]
            for _ in range(args.steps):
                t0 = clock()
                outs, _ = eng.step()
                times[name].append(clock() - t0)
                if len(outs) != batch:
                    raise RuntimeError(f"{name}: {len(outs)} of {batch} sequences decoded a step")
        say(f"decode {batch}: round {r + 1}/{args.rounds}")
    for eng in engines.values():
        for i in range(batch):
            eng.abort(f"d{batch}-{i}")
    return times


def prefill(engines: dict[str, Any], args: argparse.Namespace, say) -> dict:
    """Seconds of one --prefill-len prompt in, first token out, per engine per round."""
    rng = random.Random(args.seed - 1)
    vocab = next(iter(engines.values())).model_config.vocab_size
    clock = _clock(args.clock)
    times: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(-1, args.rounds):  # round -1: the warm-up
        prompt = random_prompt(rng, args.prefill_len, vocab)
        for name in _order(list(engines), max(r, 0)):
            eng = engines[name]
            t0 = clock()
            eng.add_request(f"p{r}", prompt, _greedy(1))
            while eng.has_unfinished():
                eng.step()
            if r >= 0:
                times[name].append(clock() - t0)
        if r >= 0:
            say(f"prefill: round {r + 1}/{args.rounds}")
    return times


def summarize(times: dict[str, list[float]], tokens: int) -> dict[str, dict[str, float]]:
    """Median ms per step (or prefill) and tokens/s per configuration, and each one's speed over
    the first's (above 1: faster than the baseline)."""
    med = {n: statistics.median(t) for n, t in times.items()}
    base = next(iter(med.values()))
    return {
        n: {
            "ms": 1e3 * m,
            "tokens_per_s": tokens / m,
            "speed_vs_first": base / m,
            "samples": len(times[n]),
        }
        for n, m in med.items()
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    def say(msg: str) -> None:
        print(f"[decode_ab] {msg}", file=sys.stderr, flush=True)

    machine = machine_info(args.threads)  # its load figure is the load at the start
    tokens = args.prompt_len + _decode_tokens(args) + 8
    engines: dict[str, Any] = {}
    for cfg in args.config_list:
        say(f"loading {cfg.name}")
        engines[cfg.name] = build_engine(cfg, args, max(tokens, args.prefill_len + 2))
    workloads: dict[str, dict] = {}

    def done(name: str, rows: dict[str, dict[str, float]]) -> None:
        workloads[name] = rows
        say(f"{name}: " + ", ".join(f"{n} {r['ms']:.2f} ms" for n, r in rows.items()))

    for b in args.batch_list:
        done(f"decode {b}", summarize(decode(engines, b, args, say), b))
    if args.prefill_len:
        done(
            f"prefill {args.prefill_len}", summarize(prefill(engines, args, say), args.prefill_len)
        )
    return {
        "machine": machine,
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "clock": args.clock,
        "model": args.model,
        "prompt_len": args.prompt_len,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "configs": [c.name for c in args.config_list],
        "workloads": workloads,
    }


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"{m['cpu']} ({', '.join(m['isa']) or 'no AVX2'}), {m['threads']} thread(s), "
        f"load {m['load_avg_1m_at_start']} -> {result['load_avg_1m_at_end']}, "
        f"{result['clock']} clock, {result['rounds']} rounds",
        f"{'workload':<14}{'config':<18}{'ms':>10}{'tok/s':>10}{'vs first':>10}",
    ]
    for w, rows in result["workloads"].items():
        for name, r in rows.items():
            lines.append(
                f"{w:<14}{name:<18}{r['ms']:>10.2f}{r['tokens_per_s']:>10.1f}"
                f"{r['speed_vs_first']:>9.2f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
