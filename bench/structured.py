"""`python -m bench.structured`: the cost of constrained decoding, measured in one run.

- Grammar compile time over the schema corpus (bench/data/json_schemas.json), each schema
  compiled fresh against the model's tokenizer (engine/guided.py, llguidance): p50/p99 of the
  compile alone, and of compile + the first mask (llguidance builds its lexer lazily, so the first
  mask of a new grammar carries part of the work); plus a cache hit.
- Decode tokens/s with and without a JSON-schema mask, at batch 1 and batch 32 (greedy, the same
  chat prompts): the schema (an array of >= 100 person objects) cannot end within --tokens, so
  both runs make the same number of tokens. Runs alternate plain/guided --repeats times; the
  best of each is reported (a loaded machine only ever slows a run down).
- The mask's cost as a fraction of a decode step: the time inside `GuidedDecoding.mask` and
  `advance` (bitmask fill, unpack, apply, matcher update) over the guided run's step time, and
  the throughput ratio. Target: <= 10 %.

Progress on stderr; JSON (--json) or a short table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.flops import machine_info

CORPUS = Path(__file__).parent / "data" / "json_schemas.json"
#: decode-throughput schema: it cannot close within a short run, so every request runs to --tokens
LONG_SCHEMA = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age"],
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
    },
}
TOPICS = [
    "people in a book club",
    "a football team",
    "guests at a wedding",
    "a school class",
    "neighbours",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.structured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", help="engine dtype (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--tokens", type=int, default=64, help="output tokens per request (default: %(default)s)"
    )
    p.add_argument(
        "--batches", default="1,32", help="batch sizes, comma-separated (default: %(default)s)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="plain/guided runs per batch size (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p.parse_args(argv)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def compile_times(eng: Any) -> dict[str, Any]:
    from engine.guided import GuidedDecoding
    from protocol.structured import Guide, GuideKind
    from text.guide_check import canonical_schema

    corpus = json.loads(CORPUS.read_text())
    gd = GuidedDecoding(
        eng.model_dir / "tokenizer.json", eng.model_config.vocab_size, eng.tokenizer.eos_token_ids
    )
    gd.compile(
        Guide(kind=GuideKind.REGEX, spec="warm")
    )  # the tokenizer's one-time load is not a compile
    import torch

    logits = torch.zeros(1, eng.model_config.vocab_size)
    alone, with_mask, hits = [], [], []
    for i, schema in enumerate(corpus.values()):
        g = Guide(kind=GuideKind.JSON_SCHEMA, spec=canonical_schema(schema))
        t0 = time.perf_counter()
        gd.compile(g)
        t1 = time.perf_counter()
        gd.attach(f"c{i}", g, [])
        gd.mask(logits, [(0, f"c{i}")])
        t2 = time.perf_counter()
        gd.compile(g)
        hits.append(time.perf_counter() - t2)
        alone.append(t1 - t0)
        with_mask.append(t2 - t0)
        gd.forget(f"c{i}")
    gd.close()
    ms = lambda xs, q: round(1e3 * _pct(xs, q), 3)  # noqa: E731
    return {
        "schemas": len(corpus),
        "compile_ms_p50": ms(alone, 0.5),
        "compile_ms_p99": ms(alone, 0.99),
        "compile_ms_max": ms(alone, 1.0),
        "compile_and_first_mask_ms_p50": ms(with_mask, 0.5),
        "compile_and_first_mask_ms_p99": ms(with_mask, 0.99),
        "cache_hit_us_p50": round(1e6 * _pct(hits, 0.5), 2),
    }


class _Timed:
    """Wraps the engine's GuidedDecoding.mask/advance and sums their wall and thread CPU time,
    and counts the rows `mask` was given (guided rows: what a run masked, whatever the timing)."""

    def __init__(self, gd: Any) -> None:
        self.gd, self.wall, self.cpu, self.rows = gd, 0.0, 0.0, 0
        self._mask, self._advance = gd.mask, gd.advance
        gd.mask, gd.advance = self._wrap(self._counted(self._mask)), self._wrap(self._advance)

    def _counted(self, mask: Any) -> Any:
        def counted(logits: Any, rows: list[tuple[int, str]], *a: Any, **kw: Any) -> Any:
            self.rows += len(rows)
            return mask(logits, rows, *a, **kw)

        return counted

    def _wrap(self, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.wall += time.perf_counter() - t
                self.cpu += time.thread_time() - c

        return timed

    def reset(self) -> None:
        self.wall = self.cpu = 0.0
        self.rows = 0


def decode_run(
    eng: Any, prompts: list[list[int]], tokens: int, guide: Any, timer: _Timed
) -> dict[str, Any]:
    """Add every prompt, run until each has its first token (prefill), then time the decode
    steps to the end: tokens/s, step time, and the mask's share of it."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, guide=guide)
    ids = [f"b{len(prompts)}-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        eng.add_request(rid, p, params)
    seen: set[str] = set()
    while len(seen) < len(ids):
        outs, _ = eng.step()
        seen.update(o.request_id for o in outs if o.new_token_ids)
    timer.reset()
    n, steps = 0, 0
    t0, c0 = time.perf_counter(), time.process_time()
    while eng.has_unfinished():
        outs, _ = eng.step()
        steps += 1
        n += sum(len(o.new_token_ids) for o in outs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "decode_tokens": n,
        "steps": steps,
        "decode_tokens_per_s": round(n / wall, 2),
        "step_ms": round(1e3 * wall / steps, 3),
        "cpu_ms_per_token": round(1e3 * cpu / n, 3),
        "masked_rows": timer.rows,
        "mask_ms_per_step": round(1e3 * timer.wall / steps, 4),
        "mask_share_of_step": round(timer.wall / wall, 4),
        "mask_cpu_share": round(timer.cpu / cpu, 4) if cpu > 0 else None,
    }


def run(args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    import torch

    from engine.config import EngineConfig
    from engine.core import EngineCore
    from protocol.structured import Guide, GuideKind
    from text.guide_check import canonical_schema

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b]
    progress(f"loading {args.model}")
    eng = EngineCore(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            threads=args.threads,
            max_model_len=1024,
            max_num_seqs=max(batches),
            enable_prefix_caching=False,
            num_kv_blocks=max(batches) * (1024 // 16) + 16,
        )
    )
    result: dict[str, Any] = {
        "machine": machine_info(torch.get_num_threads()),
        "grammar_engine": _engine_version(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }
    progress("compiling the corpus")
    result["compile"] = compile_times(eng)
    progress(
        f"compile p50 {result['compile']['compile_ms_p50']} ms, p99 "
        f"{result['compile']['compile_ms_p99']} ms"
    )
    guide = Guide(kind=GuideKind.JSON_SCHEMA, spec=canonical_schema(LONG_SCHEMA))
    timer = _Timed(eng.guides)
    tok = eng.tokenizer
    prompts = [
        tok.encode_chat(
            [
                {
                    "role": "user",
                    "content": f"List the {TOPICS[i % len(TOPICS)]} ({i}) with names "
                    "and ages, as JSON.",
                }
            ]
        )
        for i in range(max(batches))
    ]
    decode_run(eng, prompts[:1], 4, None, timer)  # warm-up
    for b in batches:
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "guided": []}
        for rep in range(args.repeats):
            for mode in ("plain", "guided"):
                r = decode_run(
                    eng, prompts[:b], args.tokens, guide if mode == "guided" else None, timer
                )
                runs[mode].append(r)
                progress(
                    f"batch {b} {mode} #{rep + 1}: {r['decode_tokens_per_s']} decode tokens/s, "
                    f"step {r['step_ms']} ms, mask {r['mask_ms_per_step']} ms/step"
                )
        best = {m: max(rs, key=lambda r: r["decode_tokens_per_s"]) for m, rs in runs.items()}
        g = best["guided"]
        result[f"batch_{b}"] = {
            **best,
            "guided_over_plain_tokens_per_s": round(
                g["decode_tokens_per_s"] / best["plain"]["decode_tokens_per_s"], 4
            ),
            "mask_share_of_step_median": round(
                statistics.median(r["mask_share_of_step"] for r in runs["guided"]), 4
            ),
        }
    result["target_mask_share"] = 0.10
    result["meets_target"] = all(
        result[f"batch_{b}"]["mask_share_of_step_median"] <= 0.10 for b in batches
    )
    result["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    eng.guides.close()
    return result


def _engine_version() -> str:
    from importlib.metadata import version

    return f"llguidance {version('llguidance')}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def progress(msg: str) -> None:
        print(f"[bench.structured {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    result = run(args, progress)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        c = result["compile"]
        print(
            f"{result['grammar_engine']}: compile p50 {c['compile_ms_p50']} ms, p99 "
            f"{c['compile_ms_p99']} ms (with the first mask: p50 "
            f"{c['compile_and_first_mask_ms_p50']} ms, p99 {c['compile_and_first_mask_ms_p99']} "
            f"ms) over {c['schemas']} schemas"
        )
        for k, v in result.items():
            if k.startswith("batch_"):
                print(
                    f"{k}: plain {v['plain']['decode_tokens_per_s']} tok/s, guided "
                    f"{v['guided']['decode_tokens_per_s']} tok/s "
                    f"(x{v['guided_over_plain_tokens_per_s']}); mask "
                    f"{v['mask_share_of_step_median']:.1%} of a step"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
