"""ServeConfig: everything one `duet bench serve` run was asked to do, validated once, and
saved whole with its result (API keys redacted) so a run can be understood and repeated.

Invariants: a ServeConfig that exists is coherent (bounded, one workload, endpoint-compatible
prompt format); secrets live only in `api_key` and `teams[].key` and never reach the output.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from bench.lengths import LengthDist

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
DATASETS = ("synthetic", "sharegpt", "trace")
TIERS = ("interactive", "batch")
SWEEP_PARAMS = ("request-rate", "max-concurrency")


class Team(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    key: str
    weight: float = 1.0


class MultiTurn(msgspec.Struct, frozen=True, kw_only=True):
    """The multi-turn workload's shape (bench/multiturn.py)."""

    conversations: int = 64
    users: int = 8
    turns: int = 4
    system_prompt_len: int = 256
    think_time_s: float = 2.0


class Sweep(msgspec.Struct, frozen=True, kw_only=True):
    param: str
    values: tuple[float, ...]


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True):
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    # workload
    #: "open": requests from --dataset at planned times; "multi-turn": conversations
    workload: Literal["open", "multi-turn"] = "open"
    multi_turn: MultiTurn = MultiTurn()
    dataset: str = "synthetic"
    dataset_path: str | None = None
    tokenizer: str | None = None
    prompt_format: Literal["text", "tokens"] = "text"
    vocab_size: int | None = None
    input_len: LengthDist = LengthDist(a=128)
    output_len: LengthDist = LengthDist(a=128)
    output_len_set: bool = False  # --output-len given: overrides ShareGPT/trace lengths
    prefix_groups: int = 0
    prefix_len: int = 0
    trace_block_size: int = 512
    trace_time_scale: float = 1.0
    teams: tuple[Team, ...] = ()
    tier_mix: tuple[tuple[str, float], ...] = ()
    tier_via: Literal["header", "body", "both"] = "header"
    ignore_eos: bool = False
    temperature: float | None = None
    extra_body: dict[str, Any] = {}
    # load
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0
    request_timeout: float = 300.0
    sweep: Sweep | None = None
    # measurement and output
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    scrape_urls: tuple[str, ...] = ()
    scrape_interval: float = 5.0
    label: str | None = None

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    def public(self) -> dict[str, Any]:
        """The config as saved with a result: keys redacted, inf as the string "inf"."""
        d = msgspec.to_builtins(self)
        d["api_key"] = "***" if self.api_key else None
        d["teams"] = [{"name": t.name, "weight": t.weight} for t in self.teams]
        d["input_len"] = str(self.input_len)
        d["output_len"] = str(self.output_len)
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return d


def check(cfg: ServeConfig) -> ServeConfig:
    """Refuse incoherent settings with a message that says what to change."""
    if not cfg.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {cfg.base_url!r}")
    if cfg.endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
    if cfg.dataset not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}")
    if cfg.dataset != "synthetic" and not cfg.dataset_path:
        raise ValueError(f"--dataset {cfg.dataset} needs --dataset-path FILE")
    if cfg.chat and cfg.prompt_format == "tokens":
        raise ValueError("/v1/chat/completions takes text messages: use --prompt-format text")
    if cfg.prompt_format == "tokens" and cfg.dataset == "sharegpt":
        raise ValueError("ShareGPT prompts are text: use --prompt-format text")
    if cfg.prompt_format == "tokens" and not cfg.tokenizer and not cfg.vocab_size:
        raise ValueError(
            "token-id prompts need --tokenizer MODEL (for its vocabulary) or --vocab-size N"
        )
    if cfg.workload == "multi-turn":
        _check_multi_turn(cfg)
    elif cfg.num_requests is None and cfg.duration_s is None:
        raise ValueError("give --num-requests or --duration (a run must end by itself)")
    if cfg.num_requests is not None and cfg.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    if cfg.duration_s is not None and cfg.duration_s <= 0:
        raise ValueError("--duration must be positive")
    rates = (
        cfg.sweep.values if cfg.sweep and cfg.sweep.param == "request-rate" else (cfg.request_rate,)
    )
    closed = cfg.max_concurrency is not None or (
        cfg.sweep is not None and cfg.sweep.param == "max-concurrency"
    )
    if (
        cfg.num_requests is None
        and not closed
        and cfg.workload == "open"
        and cfg.dataset != "trace"
        and any(map(math.isinf, rates))
    ):
        raise ValueError(
            "--duration with an infinite --request-rate needs --max-concurrency or "
            "--num-requests (otherwise it would send without limit at t=0)"
        )
    if cfg.request_rate <= 0 or cfg.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if cfg.request_timeout <= 0:
        raise ValueError("--request-timeout must be positive")
    if cfg.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if (cfg.prefix_groups > 0) != (cfg.prefix_len > 0):
        raise ValueError("--prefix-groups and --prefix-len go together (both positive)")
    if cfg.prefix_groups and cfg.dataset != "synthetic":
        raise ValueError("--prefix-groups applies to the synthetic dataset only")
    if cfg.trace_block_size < 1 or cfg.trace_time_scale <= 0:
        raise ValueError("--trace-block-size and --trace-time-scale must be positive")
    if cfg.dataset == "trace" and not math.isinf(cfg.request_rate):
        raise ValueError(
            "a trace is replayed at its own timestamps: drop --request-rate "
            "(use --trace-time-scale to speed it up or slow it down)"
        )
    if cfg.sweep and cfg.dataset == "trace" and cfg.sweep.param == "request-rate":
        raise ValueError("a trace sets its own send times: sweep max-concurrency instead")
    for t, w in cfg.tier_mix:
        if t not in TIERS or w <= 0:
            raise ValueError(
                f"--tier-mix takes {'/'.join(TIERS)} with positive weights, got {t}:{w:g}"
            )
    for team in cfg.teams:
        if team.weight <= 0 or not team.key:
            raise ValueError(f"team {team.name!r} needs a key and a positive weight")
    for p in cfg.percentiles:
        if not 0 < p <= 100:
            raise ValueError(f"percentiles must be in (0, 100], got {p:g}")
    if cfg.scrape_interval <= 0:
        raise ValueError("--scrape-interval must be positive")
    return cfg


def _check_multi_turn(cfg: ServeConfig) -> None:
    mt = cfg.multi_turn
    if min(mt.conversations, mt.users, mt.turns) < 1 or mt.system_prompt_len < 0:
        raise ValueError(
            "--conversations, --users and --turns must be at least 1, --system-prompt-len >= 0"
        )
    if mt.think_time_s < 0:
        raise ValueError("--think-time-s must be >= 0")
    if cfg.dataset != "synthetic" or cfg.prefix_groups or cfg.sweep is not None:
        raise ValueError(
            "--workload multi-turn makes its own prompts: no --dataset, --prefix-groups or --sweep"
        )
    if not math.isinf(cfg.request_rate) or cfg.max_concurrency is not None:
        raise ValueError(
            "--workload multi-turn is a closed loop of --users conversations: "
            "no --request-rate or --max-concurrency"
        )
    if cfg.prompt_format == "tokens" and not cfg.tokenizer:
        raise ValueError("multi-turn token-id prompts re-encode answers: give --tokenizer MODEL")
