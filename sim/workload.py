"""What arrives at the simulated gateway: (time, prompt token ids, max_tokens, tier, team).

Three sources, each lazy (an hour of traffic never sits in memory at once):
- a distribution (`Synthetic`): the same gamma arrival process and length distributions as
  `duet bench serve` (bench.arrivals, bench.lengths), shared prompt prefixes, a tier mix;
- a `duet bench serve --result-file` JSON: its scheduled send times, prompt and output lengths
  and tiers, replayed (prompt content: random, with the run's prefix groups when it had some);
- a Mooncake trace (bench.trace's reader): timestamps, lengths, and `hash_ids`, where equal
  ids give equal token blocks, so its prefix sharing reaches the simulated prefix caches.

Invariants: items come in non-decreasing time; token ids are a function of the seed only
(one seed, one workload); a prefix group's prefix is the same ids in every request of it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.arrivals import send_offsets
from bench.lengths import LengthDist, parse_length
from bench.trace import load_trace
from protocol.route import Tier

VOCAB = 32000


@dataclass(frozen=True)
class WorkItem:
    t: float
    prompt: list[int]
    max_tokens: int
    tier: Tier = "interactive"
    team: str = "default"


@dataclass(frozen=True)
class Synthetic:
    rate: float  # requests/s
    duration_s: float
    input_len: str = "128"
    output_len: str = "128"
    burstiness: float = 1.0
    prefix_groups: int = 0
    prefix_len: int = 0
    tier_mix: tuple[tuple[str, float], ...] = (("interactive", 1.0),)
    teams: int = 1
    seed: int = 0
    #: stop after this many requests (None: the duration decides)
    num_requests: int | None = None

    def lengths(self) -> tuple[LengthDist, LengthDist]:
        return parse_length(self.input_len), parse_length(self.output_len)

    def mean_tokens(self) -> tuple[float, float]:
        i, o = self.lengths()
        return i.mean + self.prefix_len, o.mean


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(2, VOCAB, size=n).tolist()


def synthetic(w: Synthetic) -> Iterator[WorkItem]:
    if math.isinf(w.rate) and w.num_requests is None:
        raise ValueError("an infinite rate needs a request count")
    rng = random.Random(w.seed)
    nrng = np.random.default_rng(w.seed)
    in_d, out_d = w.lengths()
    prefixes = [_tokens(nrng, w.prefix_len) for _ in range(w.prefix_groups)]
    tiers, weights = zip(*w.tier_mix, strict=True)
    for i, t in enumerate(send_offsets(w.rate, w.burstiness, rng)):
        if (w.num_requests is not None and i >= w.num_requests) or (
            w.num_requests is None and t > w.duration_s
        ):
            return
        prompt = _tokens(nrng, in_d.sample(rng))
        if prefixes:
            prompt = prefixes[i % len(prefixes)] + prompt
        yield WorkItem(
            t, prompt, out_d.sample(rng), rng.choices(tiers, weights)[0], f"team{i % w.teams}"
        )


def from_result_file(path: Path, seed: int = 0) -> Iterator[WorkItem]:
    """Replay a `duet bench serve --result-file` JSON (one run, not a sweep)."""
    try:
        r = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read bench result {path}: {e}") from None
    need = ("scheduled_times", "input_lens", "output_lens")
    if not all(k in r for k in need):
        raise ValueError(
            f"{path}: not a `duet bench serve` result of one run (needs {', '.join(need)})"
        )
    cfg = r.get("config") or {}
    groups, plen = int(cfg.get("prefix_groups") or 0), int(cfg.get("prefix_len") or 0)
    n = len(r["input_lens"])
    # how many tokens each prompt shares with its group's prefix as the server tokenized it: text
    # prompts do not round-trip random ids, so a 384-id prefix was ~400 tokens (round 8, 05 Dec:
    # replayed at 384, every prefix hit computed 16 tokens too many, +22 ms). Older results: plen.
    shared = [plen if x is None else x for x in (r.get("prefix_tokens") or [None] * n)]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shared):
        raise ValueError(f"{path}: prefix_tokens must be whole numbers of tokens >= 0 (or null)")
    nrng = np.random.default_rng(seed)
    prefixes = [_tokens(nrng, max([plen, *shared])) for _ in range(groups)]
    tiers = r.get("tiers") or [None] * n
    # each prompt's group as the bench drew it (at random: which prompt is a group's first, and
    # so a cold prefill, decides routing); a result from before the field: round robin
    recorded = r.get("groups") or [None] * n
    out_default = _max_tokens(cfg)
    rows = sorted(
        zip(
            r["scheduled_times"],
            r["input_lens"],
            r["output_lens"],
            tiers,
            recorded,
            shared,
            strict=True,
        ),
        key=lambda row: row[0],
    )
    for i, (t, n_in, n_out, tier, group, k) in enumerate(rows):
        n_out = n_out or out_default  # a failed request reports 0: replay what it asked for
        if group is not None and not 0 <= group < len(
            prefixes
        ):  # none at all: not a --prefix-groups run
            raise ValueError(
                f"{path}: request {i}'s prefix group {group} is not one of the {len(prefixes)} "
                "groups"
            )
        g = group if group is not None else i % len(prefixes) if prefixes else None
        k = min(k, n_in - 1) if g is not None else 0  # at least one token of its own
        body = _tokens(nrng, max(1, n_in - k))
        prompt = prefixes[g][:k] + body if g is not None else body
        yield WorkItem(float(t), prompt, max(1, int(n_out)), tier or "interactive")


def _max_tokens(cfg: dict) -> int:
    spec = cfg.get("output_len")
    try:
        return round(parse_length(str(spec)).mean) if spec else 128
    except ValueError:
        return 128


def mooncake(
    path: Path, block_size: int = 512, time_scale: float = 1.0, seed: int = 0
) -> Iterator[WorkItem]:
    entries = load_trace(Path(path))
    t0 = entries[0].timestamp
    blocks: dict[int, list[int]] = {}
    for e in entries:
        prompt: list[int] = []
        for h in e.hash_ids:
            if h not in blocks:
                blocks[h] = _tokens(np.random.default_rng((seed, h)), block_size)
            prompt.extend(blocks[h])
        prompt = prompt[: e.input_length]
        if len(prompt) < e.input_length:
            prompt.extend(
                _tokens(
                    np.random.default_rng((seed, -1, int(e.timestamp * 1000), e.input_length)),
                    e.input_length - len(prompt),
                )
            )
        yield WorkItem((e.timestamp - t0) / 1000.0 * time_scale, prompt, e.output_length)
