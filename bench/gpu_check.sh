#!/usr/bin/env bash
# GPU check of the vLLM engine (`--engine vllm`). Never part of CI: it needs an NVIDIA GPU and
# installs vLLM's CUDA build (several GB).
#
#   bench/gpu_check.sh [MODEL]        (default: smollm2-135m-instruct, pulled with `duet models pull`)
#
# 1. installs duet[vllm] (vLLM's CUDA build + nixl) into ./.venv-gpu (reused when present;
#    VENV=path to use another one),
# 2. starts on one GPU: a prefill node and a decode node (--engine vllm, P/D through vLLM's
#    NixlConnector over CUDA memory) and one colocated node (--role both), each with a share of
#    the GPU's memory,
# 3. sends the same requests disaggregated (P → D) and colocated, sequentially and then
#    CONCURRENCY at a time, and prints one JSON object: TTFT, TPOT (median, p90) and output
#    throughput per mode, with the ratio disaggregated/colocated. Exit 1 if any request failed
#    or the two modes' greedy tokens differ.
# Every process it starts is stopped on exit. Environment knobs: REQUESTS (default 32),
# PROMPT_LEN (512), OUTPUT_LEN (64), CONCURRENCY (8), GPU_SHARE (0.25 of the GPU per node).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2-135m-instruct}
VENV=${VENV:-.venv-gpu}
REQUESTS=${REQUESTS:-32}
PROMPT_LEN=${PROMPT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-64}
CONCURRENCY=${CONCURRENCY:-8}
GPU_SHARE=${GPU_SHARE:-0.25}

command -v nvidia-smi >/dev/null || { echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing)" >&2; exit 2; }
if [ ! -x "$VENV/bin/python" ]; then
  echo "gpu_check: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c 'import vllm, nixl._api, duet' 2>/dev/null; then
  echo "gpu_check: installing duet[vllm] (vLLM's CUDA build; minutes)" >&2
  "$PY" -m pip install -q --disable-pip-version-check -e '.[test,vllm]'
fi
"$PY" -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"'
"$PY" -m duet models pull "$MODEL" >&2

LOGS=$(mktemp -d -t duet-gpu-check-XXXX)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 2
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

COMMON=(--engine vllm --model "$MODEL" --device cuda --max-model-len 4096
        --vllm-arg "gpu_memory_utilization=$GPU_SHARE")
start() {  # ROLE PORT NIXL_PORT
  setsid "$PY" -m duet node --role "$1" --port "$2" --nixl-port "$3" "${COMMON[@]}" \
    >"$LOGS/$1-$2.log" 2>&1 &
  PIDS+=($!)
}
# One at a time: vLLM sizes its KV pool from the GPU memory free when it starts.
wait_healthy() {  # PORT
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    sleep 1
  done
  echo "gpu_check: node on port $1 not healthy; logs in $LOGS" >&2
  exit 1
}
start prefill 18100 18101; wait_healthy 18100
start decode 18200 18201; wait_healthy 18200
start both 18300 18301; wait_healthy 18300
echo "gpu_check: nodes up (logs in $LOGS)" >&2

"$PY" - "$MODEL" "$REQUESTS" "$PROMPT_LEN" "$OUTPUT_LEN" "$CONCURRENCY" <<'EOF'
import asyncio, json, random, statistics, sys, time

import aiohttp

from bench.pd_client import completion, disaggregated

model, n, plen, olen, conc = sys.argv[1], *map(int, sys.argv[2:])
P, D, BOTH = "http://127.0.0.1:18100", "http://127.0.0.1:18200", "http://127.0.0.1:18300"
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(plen)] for _ in range(n)]
params = {"max_tokens": olen, "temperature": 0, "ignore_eos": True}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def run(mode, concurrency, s):
    sem = asyncio.Semaphore(concurrency)

    async def one(x):
        async with sem:
            if mode == "disaggregated":
                return await disaggregated(s, P, D, x, params)
            return await completion(s, BOTH, x, params)

    t0 = time.perf_counter()
    rs = await asyncio.gather(*(one(x) for x in prompts))
    wall = time.perf_counter() - t0
    bad = [r.error for r in rs if r.error is not None or not r.token_ids]
    ttft = [r.ttft for r in rs if r.ttft is not None]
    tpot = [(r.latency - r.ttft) / (len(r.token_ids) - 1) for r in rs if r.ttft and len(r.token_ids) > 1]
    out = sum(len(r.token_ids) for r in rs)
    return rs, {"requests": len(rs), "failed": len(bad), "errors": bad[:3],
                "ttft_s": {"median": statistics.median(ttft) if ttft else None, "p90": pct(ttft, 0.9)},
                "tpot_s": {"median": statistics.median(tpot) if tpot else None, "p90": pct(tpot, 0.9)},
                "output_tokens_per_s": out / wall, "wall_s": wall}


async def main():
    report = {"model": model, "prompt_len": plen, "output_len": olen, "requests": n,
              "transfer": "vLLM NixlConnector, CUDA memory", "runs": {}}
    ok = True
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await completion(s, BOTH, prompts[0][:32], {"max_tokens": 2})  # warm-up
        await disaggregated(s, P, D, prompts[0][:32], {"max_tokens": 2})
        for c in (1, conc):
            got = {}
            for mode in ("colocated", "disaggregated"):
                rs, summary = await run(mode, c, s)
                got[mode] = rs
                report["runs"][f"{mode}_c{c}"] = summary
                ok &= summary["failed"] == 0
            same = all(a.token_ids == b.token_ids for a, b in zip(got["colocated"], got["disaggregated"]))
            report["runs"][f"same_greedy_tokens_c{c}"] = same
            ok &= same
            co, di = report["runs"][f"colocated_c{c}"], report["runs"][f"disaggregated_c{c}"]
            if co["ttft_s"]["median"] and di["ttft_s"]["median"]:
                report["runs"][f"ratio_c{c}"] = {
                    "ttft": di["ttft_s"]["median"] / co["ttft_s"]["median"],
                    "tpot": (di["tpot_s"]["median"] or 0) / (co["tpot_s"]["median"] or 1),
                    "throughput": di["output_tokens_per_s"] / co["output_tokens_per_s"]}
    print(json.dumps(report, indent=2))
    sys.exit(0 if ok else 1)


asyncio.run(main())
EOF
