"""`python -m bench.peers`: the engines duet is compared with, on bench.engine_tiers' workloads,
each in its own process on this machine: transformers (fp32, and bf16 where it is faster), vLLM's
CPU build and llama.cpp (through llama-cpp-python, on the model's GGUF: its Q4_1 source, or
`--gguf` another precision, named in the row by the file's name, e.g. `*.q8_0.gguf`).

- W1: one 512-token prompt prefilled (prompt tokens/s; the best of `--reps`);
- W2: single-stream greedy decode of 128 tokens after a 256-token prompt (decode tokens/s: the
  tokens after the first over the time a 128-token generation takes beyond a 1-token one);
- W3: 32 prompts x 256 tokens -> 128 tokens each (output tokens/s, prefill included). llama.cpp's
  Python API decodes one sequence at a time, so its W3 is the 32 requests one after another.

Prompts are random token ids from the same seed for every engine. vLLM and llama.cpp run from
their own virtual environments (`--vllm-python`, `--llama-python`, or DUET_VLLM_PYTHON /
DUET_LLAMA_PYTHON); a peer whose interpreter or package is absent is reported as absent, with
the reason, and the others still run. Each peer's process gets `--threads` threads.
Progress on stderr; one JSON object on stdout with --json, else a table.

Invariant: timing only; no figure here is compared against a bound in a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: where this project's machines keep the peers' environments (override with the flags)
_VLLM_DEFAULT = str(Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python")
_LLAMA_DEFAULT = "/work/peers/llama/bin/python"

#: the workload shapes every peer runs (bench.engine_tiers' defaults)
_SHAPES = {
    "prefill": 512,
    "w2_context": 256,
    "w2_tokens": 128,
    "batch": 32,
    "w3_in": 256,
    "w3_out": 128,
}

# Each peer's runner: a script run with the peer's own interpreter (no duet import: those
# environments have only the peer). It reads {"model", "gguf", "threads", "seed", "reps",
# "workloads", shapes...} as JSON on stdin and prints one JSON line of tokens/s per workload.
_COMMON = r"""
import json, random, sys, time
cfg = json.loads(sys.stdin.read())
rng = random.Random(cfg["seed"])
def prompt(n, vocab):
    return [rng.randrange(100, vocab - 100) for _ in range(n)]
def best(fn, reps):
    out = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return min(out)
res = {}
"""

_TRANSFORMERS = (
    _COMMON
    + r"""
import torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(cfg["threads"])
dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["dtype"]]
model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=dtype).eval()
vocab = model.config.vocab_size
def gen(ids, n, batch=False):
    with torch.inference_mode():
        x = torch.tensor(ids if batch else [ids])
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
if "W1" in cfg["workloads"]:
    p = prompt(cfg["prefill"], vocab)
    with torch.inference_mode():
        model(torch.tensor([p[:32]]))
        res["W1"] = cfg["prefill"] / best(lambda: model(torch.tensor([p])), cfg["reps"])
if "W2" in cfg["workloads"]:
    p = prompt(cfg["w2_context"], vocab)
    gen(p, 4)
    t1 = best(lambda: gen(p, 1), 2)
    tn = best(lambda: gen(p, cfg["w2_tokens"]), 1)
    res["W2"] = (cfg["w2_tokens"] - 1) / (tn - t1)
if "W3" in cfg["workloads"]:
    ps = [prompt(cfg["w3_in"], vocab) for _ in range(cfg["batch"])]
    t = time.perf_counter(); gen(ps, cfg["w3_out"], batch=True)
    res["W3"] = cfg["batch"] * cfg["w3_out"] / (time.perf_counter() - t)
print(json.dumps(res))
"""
)

_VLLM = (
    _COMMON
    + r"""
import os
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=1024, enforce_eager=True, seed=0)
vocab = llm.llm_engine.model_config.get_vocab_size()
def gen(ps, n):
    sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
if "W1" in cfg["workloads"]:
    p = prompt(cfg["prefill"], vocab)
    gen([p[:32]], 1)
    res["W1"] = cfg["prefill"] / best(lambda: gen([p], 1), cfg["reps"])
if "W2" in cfg["workloads"]:
    p = prompt(cfg["w2_context"], vocab)
    gen([p], 4)
    t1 = best(lambda: gen([p], 1), 2)
    tn = best(lambda: gen([p], cfg["w2_tokens"]), 1)
    res["W2"] = (cfg["w2_tokens"] - 1) / (tn - t1)
if "W3" in cfg["workloads"]:
    ps = [prompt(cfg["w3_in"], vocab) for _ in range(cfg["batch"])]
    t = time.perf_counter(); gen(ps, cfg["w3_out"])
    res["W3"] = cfg["batch"] * cfg["w3_out"] / (time.perf_counter() - t)
print(json.dumps(res))
"""
)

_LLAMA = (
    _COMMON
    + r"""
from llama_cpp import Llama
t = cfg["threads"]
llm = Llama(model_path=cfg["gguf"], n_ctx=1024, n_batch=512, n_threads=t, n_threads_batch=t,
            verbose=False)
vocab = llm.n_vocab()
def gen(p, n):
    llm.reset()
    out = 0
    for tok in llm.generate(p, temp=0.0, reset=True):
        out += 1
        if out >= n:
            break
def prefill(p):
    llm.reset(); llm.eval(p)
if "W1" in cfg["workloads"]:
    p = prompt(cfg["prefill"], vocab)
    prefill(p[:32])
    res["W1"] = cfg["prefill"] / best(lambda: prefill(p), cfg["reps"])
if "W2" in cfg["workloads"]:
    p = prompt(cfg["w2_context"], vocab)
    gen(p, 4)
    t1 = best(lambda: gen(p, 1), 2)
    tn = best(lambda: gen(p, cfg["w2_tokens"]), 1)
    res["W2"] = (cfg["w2_tokens"] - 1) / (tn - t1)
if "W3" in cfg["workloads"]:
    ps = [prompt(cfg["w3_in"], vocab) for _ in range(cfg["batch"])]
    t0 = time.perf_counter()
    for p in ps:
        gen(p, cfg["w3_out"])
    res["W3"] = cfg["batch"] * cfg["w3_out"] / (time.perf_counter() - t0)
    res["W3_note"] = "one sequence at a time (the Python API's single-sequence decode)"
print(json.dumps(res))
"""
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or directory")
    p.add_argument("--peers", default="transformers,vllm,llama.cpp", help="comma-separated")
    p.add_argument("--workloads", default="W1,W2,W3", help="comma-separated subset of W1,W2,W3")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads per peer")
    p.add_argument("--reps", type=int, default=3, help="W1 repeats (best)")
    p.add_argument(
        "--transformers-dtypes",
        default="float32,bfloat16",
        help="the dtypes transformers runs in, one process each (default %(default)s)",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("DUET_VLLM_PYTHON", _VLLM_DEFAULT),
        help="interpreter of the virtual environment with vLLM's CPU build (env DUET_VLLM_PYTHON)",
    )
    p.add_argument(
        "--llama-python",
        default=os.environ.get("DUET_LLAMA_PYTHON", _LLAMA_DEFAULT),
        help="interpreter of the virtual environment with llama-cpp-python (env DUET_LLAMA_PYTHON)",
    )
    p.add_argument("--gguf", default=None, help="llama.cpp's GGUF (default: the model's source)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per peer and dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args(argv)


def _gguf(model_dir: Path, given: str | None) -> str | None:
    """llama.cpp's model: --gguf, else the GGUF the model was converted from, where it still is."""
    if given:
        return given
    src = model_dir / "duet-source.json"
    if src.is_file():
        path = json.loads(src.read_text()).get("gguf")
        if path and Path(path).is_file():
            return path
    return None


def gguf_kind(path: str | None) -> str:
    """The GGUF's precision as its file name says it (`SmolLM2-135M-Instruct.Q4_1.gguf`: Q4_1),
    else "GGUF"."""
    stem = Path(path or "").stem
    return stem.rsplit(".", 1)[1] if "." in stem else "GGUF"


def _run(python: str, script: str, cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One peer's runner in its interpreter: its figures, or {"absent": reason}."""
    if not Path(python).is_file():
        return {"absent": f"no interpreter at {python}"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [python, "-c", script],
            input=json.dumps(cfg),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={
                **os.environ,
                "OMP_NUM_THREADS": str(cfg["threads"]),
                "TOKENIZERS_PARALLELISM": "0",
            },
        )
    except subprocess.TimeoutExpired:
        return {"absent": f"did not finish in {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"absent": f"exit {proc.returncode}: {' | '.join(tail)[:400]}"}
    out = json.loads(lines[-1])
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def run(args: argparse.Namespace, progress) -> dict[str, Any]:
    from runtime.models import resolve_model

    model_dir = resolve_model(args.model).directory
    work = [w.strip() for w in args.workloads.split(",") if w.strip()]
    base = {
        "model": str(model_dir),
        "threads": args.threads,
        "seed": args.seed,
        "reps": args.reps,
        "workloads": work,
        **_SHAPES,
    }
    result: dict[str, Any] = {}
    for peer in [p.strip() for p in args.peers.split(",") if p.strip()]:
        if peer == "transformers":
            for dtype in [d.strip() for d in args.transformers_dtypes.split(",") if d.strip()]:
                progress(f"transformers {dtype}")
                cfg = {**base, "dtype": dtype}
                result[f"transformers {dtype}"] = _run(
                    sys.executable, _TRANSFORMERS, cfg, args.timeout_s
                )
        elif peer == "vllm":
            progress("vLLM-CPU fp32")
            cfg = {**base, "dtype": "float32"}
            result["vLLM-CPU fp32"] = _run(args.vllm_python, _VLLM, cfg, args.timeout_s)
        elif peer == "llama.cpp":
            gguf = _gguf(model_dir, args.gguf)
            name = f"llama.cpp {gguf_kind(gguf)}"
            progress(name)
            result[name] = (
                {"absent": "no GGUF (--gguf)"}
                if gguf is None
                else _run(args.llama_python, _LLAMA, {**base, "gguf": gguf}, args.timeout_s)
            )
        else:
            raise ValueError(f"unknown peer {peer!r} (transformers, vllm, llama.cpp)")
        for name, r in result.items():
            if "absent" in r:
                progress(f"{name}: absent ({r['absent']})")
    return result


def best_peer(result: dict[str, Any], workload: str) -> tuple[str, float] | None:
    """The fastest peer present on `workload`: (name, tokens/s)."""
    figures = [(n, r[workload]) for n, r in result.items() if workload in r]
    return max(figures, key=lambda f: f[1]) if figures else None


def for_tiers(args: argparse.Namespace, progress) -> dict[str, Any]:
    """The peers on bench.engine_tiers' workloads and threads (its parsed arguments)."""
    argv = ["--model", args.model, "--peers", args.peers, "--workloads", args.workloads]
    argv += ["--threads", str(args.threads or os.cpu_count() or 1)]
    for flag, value in (
        ("--vllm-python", args.vllm_python),
        ("--llama-python", args.llama_python),
        ("--gguf", args.gguf),
    ):
        if value:
            argv += [flag, value]
    return run(parse_args(argv), progress)


def against(result: dict[str, Any]) -> None:
    """Per workload of a bench.engine_tiers result with its peers: duet's best scheme over the
    best peer present (result["vs_peers"])."""
    out = {}
    for w in ("W1", "W2", "W3"):
        ours = [(s, r[w]["tokens_per_s"]) for s, r in result["schemes"].items() if w in r]
        theirs = best_peer(result["peers"], w)
        if ours and theirs:
            scheme, rate = max(ours, key=lambda f: f[1])
            out[w] = {
                "duet": scheme,
                "duet_tokens_per_s": rate,
                "peer": theirs[0],
                "peer_tokens_per_s": theirs[1],
                "ratio": rate / theirs[1],
            }
    result["vs_peers"] = out


def table(result: dict[str, Any]) -> str:
    lines = [f"{'peer':>22} {'W1 tok/s':>9} {'W2 tok/s':>9} {'W3 tok/s':>9}"]
    for name, r in result.items():
        if "absent" in r:
            lines.append(f"{name:>22}  absent: {r['absent']}")
            continue
        cells = [f"{r[w]:>9.1f}" if w in r else f"{'-':>9}" for w in ("W1", "W2", "W3")]
        lines.append(f"{name:>22} {' '.join(cells)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def progress(msg: str) -> None:
        print(f"[bench.peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    result = run(args, progress)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
