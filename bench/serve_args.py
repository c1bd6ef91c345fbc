"""Command line of `duet bench serve` (flag names follow `vllm bench serve` where one exists)
and its translation into a checked ServeConfig."""

from __future__ import annotations

import argparse
import json
import math
import os

from bench.lengths import HELP as LEN_HELP
from bench.lengths import parse_length
from bench.mix import parse_team, parse_weights
from bench.records import CAUSES
from bench.serve_config import DATASETS, ENDPOINTS, MultiTurn, ServeConfig, check
from bench.sweep import parse_sweep

DESCRIPTION = """\
Load-test any OpenAI-compatible server (a duet gateway, a single duet node, vLLM, ...) and report
TTFT, TPOT, ITL, E2EL (mean/median/percentiles), throughput, goodput and failures by cause.

Prompts: synthetic ones are random token ids of the model's vocabulary. With --prompt-format text
(default) they are decoded by the tokenizer (--tokenizer, default the duet default model) and
sent as text, which any server accepts; with --prompt-format tokens the ids themselves go in
`prompt` (exact lengths; for /v1/completions on servers that take token-id prompts: duet nodes,
vLLM). The run ends by itself: after --num-requests, or at --duration (requests in flight finish,
each within --request-timeout). Requests go only to --base-url (redirects are not followed).

examples:
  duet bench serve --base-url http://127.0.0.1:8000 --num-requests 200 --request-rate 4 \\
      --input-len lognormal:256,0.6 --output-len 128 --slo ttft=500,tpot=50 --json > run.json
  duet bench serve --base-url http://gw:8000 --endpoint /v1/chat/completions --model auto \\
      --team a:3=env:KEY_A --team b=env:KEY_B --tier-mix interactive:3,batch:1 --duration 60 \\
      --request-rate 8 --scrape-metrics http://gw:8000 --plot plots/
  duet bench serve --base-url http://127.0.0.1:8000 --sweep request-rate=1,2,4,8 \\
      --num-requests 100 --slo ttft=500 --plot sweep/
  duet bench serve --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions \\
      --workload multi-turn --conversations 96 --users 12 --turns 5 --input-len 96 \\
      --output-len 64 --ignore-eos --think-time-s 1 --plot mt/
  duet bench compare before.json after.json
"""


def build_parser() -> argparse.ArgumentParser:
    causes = "\n".join(
        f"  {k:18} {v}"
        for k, v in {"http_<status>": "the server answered with this HTTP status", **CAUSES}.items()
    )
    p = argparse.ArgumentParser(
        prog="duet bench serve",
        description=DESCRIPTION,
        epilog=f"failure causes (counted, never fatal):\n{causes}\n\n"
        "Ctrl-C once stops sending and reports what finished; twice aborts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s = p.add_argument_group("server")
    s.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    s.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    s.add_argument(
        "--model",
        default=None,
        help="model name sent in each request (default: the first "
        "from the server's /v1/models, or none if it has no such route)",
    )
    s.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY)")
    s.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds per request, stream included (default 300)",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        choices=["open", "multi-turn"],
        default="open",
        help="open (default): independent requests from --dataset, sent at planned times; "
        "multi-turn: conversations whose history grows turn by turn (see the multi-turn group)",
    )
    w.add_argument(
        "--dataset",
        choices=DATASETS,
        default="synthetic",
        help="synthetic (default), sharegpt (JSON file) or trace (Mooncake-style JSONL)",
    )
    w.add_argument("--dataset-path", default=None, help="the ShareGPT JSON or trace JSONL file")
    w.add_argument(
        "--tokenizer",
        default=None,
        help="model name, model directory or tokenizer.json directory that builds "
        "and measures prompts (default for text prompts: smollm2-135m-instruct)",
    )
    w.add_argument(
        "--prompt-format",
        choices=["text", "tokens"],
        default="text",
        help="send prompts as text (any server) or token ids (/v1/completions on duet/vLLM)",
    )
    w.add_argument(
        "--vocab-size", type=int, default=None, help="token-id prompts without a tokenizer"
    )
    w.add_argument(
        "--input-len", default="128", help=f"prompt tokens per request: {LEN_HELP} (default 128)"
    )
    w.add_argument(
        "--output-len",
        default=None,
        help=f"max_tokens per request: {LEN_HELP} (default 128; "
        "for sharegpt/trace it overrides the file's lengths)",
    )
    w.add_argument("--prefix-groups", type=int, default=0, help="number of shared prompt prefixes")
    w.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="tokens in each shared prefix (before --input-len)",
    )
    w.add_argument(
        "--trace-block-size", type=int, default=512, help="tokens per trace hash id (Mooncake: 512)"
    )
    w.add_argument(
        "--trace-time-scale",
        type=float,
        default=1.0,
        help="multiply trace gaps (0.5 = twice as fast)",
    )
    w.add_argument(
        "--team",
        action="append",
        default=[],
        metavar="NAME[:W]=KEY",
        help="a team with its API key (KEY or env:VAR) and weight; repeat for a mix",
    )
    w.add_argument("--tier-mix", default="", help="e.g. interactive:3,batch:1")
    w.add_argument(
        "--tier-via",
        choices=["header", "body", "both"],
        default="header",
        help="send the tier as the x-duet-tier header, the service_tier field, or both",
    )
    w.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM/duet extension)"
    )
    w.add_argument("--temperature", type=float, default=None)
    w.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    m = p.add_argument_group(
        "multi-turn (--workload multi-turn)",
        "Each team (--team; one without) has its own system prompt; a conversation sends --turns "
        "requests, each the whole history so far (its system prompt, every user message of "
        "--input-len tokens and the server's answer of up to --output-len) plus a new user "
        "message, after a think time. --users conversations run at once (a closed loop), until "
        "--conversations ran, --num-requests turns were sent or --duration passed. The result "
        "reports the working set (every final history, and the system prompts, in tokens): size "
        "it against the cluster's KV memory.",
    )
    m.add_argument("--conversations", type=int, default=64, help="conversations in the run (64)")
    m.add_argument("--users", type=int, default=8, help="conversations in flight at once (8)")
    m.add_argument("--turns", type=int, default=4, help="requests per conversation (4)")
    m.add_argument(
        "--system-prompt-len",
        type=int,
        default=256,
        help="tokens of each team's system prompt, shared by its conversations (256)",
    )
    m.add_argument(
        "--think-time-s",
        type=float,
        default=2.0,
        help="mean seconds between an answer and the next turn (exponential; 0: none; 2)",
    )
    lo = p.add_argument_group("load")
    lo.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s, Poisson by default; inf (default) sends all at t=0",
    )
    lo.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)"
    )
    lo.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    lo.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests to send (default 100 without --duration)",
    )
    lo.add_argument("--duration", type=float, default=None, help="seconds to keep sending")
    lo.add_argument(
        "--warmup", type=int, default=0, help="requests sent first and left out of the results"
    )
    lo.add_argument("--seed", type=int, default=0)
    lo.add_argument(
        "--sweep", default=None, help="request-rate=1,2,4 or max-concurrency=1,4,16: one run each"
    )
    o = p.add_argument_group("measurement and output")
    o.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft=500,tpot=50")
    o.add_argument(
        "--percentiles", default="50,90,99", help="percentiles to report (default 50,90,99)"
    )
    o.add_argument(
        "--scrape-metrics", default="", metavar="URL[,URL]", help="Prometheus endpoints to scrape"
    )
    o.add_argument(
        "--scrape-interval", type=float, default=5.0, help="seconds between scrapes during the run"
    )
    o.add_argument(
        "--json", action="store_true", help="print the result as one JSON object on stdout"
    )
    o.add_argument("--result-file", default=None, help="also write the JSON result to this file")
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots to DIR")
    o.add_argument("--label", default=None, help="name of this run in tables, plots and compare")
    o.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def parse_slo(spec: str | None) -> tuple[float | None, float | None]:
    if not spec:
        return None, None
    found: dict[str, float] = {}
    for part in spec.replace(" ", ",").split(","):
        if not part:
            continue
        k, sep, v = part.replace(":", "=").partition("=")
        try:
            if k not in ("ttft", "tpot") or not sep:
                raise ValueError
            found[k] = float(v)
            if found[k] <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"cannot read --slo {spec!r}: use ttft=MS,tpot=MS (positive numbers)"
            ) from None
    return found.get("ttft"), found.get("tpot")


def to_config(a: argparse.Namespace) -> ServeConfig:
    extra = {}
    if a.extra_body:
        try:
            extra = json.loads(a.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    slo_ttft, slo_tpot = parse_slo(a.slo)
    try:
        pcts = tuple(float(x) for x in a.percentiles.split(",") if x.strip())
    except ValueError:
        raise ValueError(
            f"cannot read --percentiles {a.percentiles!r}: use e.g. 50,90,99"
        ) from None
    num = a.num_requests
    if num is None and a.duration is None and a.workload == "open":
        num = 100
    return check(
        ServeConfig(
            base_url=a.base_url,
            endpoint=a.endpoint,
            model=a.model,
            api_key=a.api_key or os.environ.get("OPENAI_API_KEY") or None,
            workload=a.workload,
            multi_turn=MultiTurn(
                conversations=a.conversations,
                users=a.users,
                turns=a.turns,
                system_prompt_len=a.system_prompt_len,
                think_time_s=a.think_time_s,
            ),
            dataset=a.dataset,
            dataset_path=a.dataset_path,
            tokenizer=a.tokenizer,
            prompt_format=a.prompt_format,
            vocab_size=a.vocab_size,
            input_len=parse_length(a.input_len),
            output_len=parse_length(a.output_len or "128"),
            output_len_set=a.output_len is not None,
            prefix_groups=a.prefix_groups,
            prefix_len=a.prefix_len,
            trace_block_size=a.trace_block_size,
            trace_time_scale=a.trace_time_scale,
            teams=tuple(parse_team(t) for t in a.team),
            tier_mix=parse_weights(a.tier_mix, "--tier-mix"),
            tier_via=a.tier_via,
            ignore_eos=a.ignore_eos,
            temperature=a.temperature,
            extra_body=extra,
            request_rate=a.request_rate,
            burstiness=a.burstiness,
            max_concurrency=a.max_concurrency,
            num_requests=num,
            duration_s=a.duration,
            warmup=a.warmup,
            seed=a.seed,
            request_timeout=a.request_timeout,
            sweep=parse_sweep(a.sweep) if a.sweep else None,
            slo_ttft_ms=slo_ttft,
            slo_tpot_ms=slo_tpot,
            percentiles=pcts,
            scrape_urls=tuple(u.strip() for u in a.scrape_metrics.split(",") if u.strip()),
            scrape_interval=a.scrape_interval,
            label=a.label,
        )
    )
