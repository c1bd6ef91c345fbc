"""Workloads for `duet bench serve`: endless (or, for a trace, finite) iterators of
BenchRequest. `synthetic` draws prompt and output lengths from distributions, optionally on top
of shared prefixes (`--prefix-groups G --prefix-len L`: G distinct prefixes of L tokens, each
request takes one at random and adds its own --input-len tokens, so a prefix cache can hit);
`sharegpt` takes the first human turn of each conversation as the prompt and the length of the
reply as the output length; `trace` (bench.trace) replays a Mooncake-style JSONL.

Invariant: a workload is a pure function of its config and seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import msgspec

from bench.lengths import LengthDist
from bench.prompts import PromptBuilder, shared_prefix


class BenchRequest(msgspec.Struct, frozen=True, kw_only=True):
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    #: send offset from the start of the run (trace replay); None: the arrival process decides
    arrival_s: float | None = None
    #: shared-prefix group (synthetic with --prefix-groups)
    group: int | None = None
    #: tokens this prompt shares with its group's prefix, as the server tokenizes it (None: no
    #: group)
    prefix_tokens: int | None = None


def synthetic(
    builder: PromptBuilder,
    input_len: LengthDist,
    output_len: LengthDist,
    seed: int,
    prefix_groups: int = 0,
    prefix_len: int = 0,
) -> Iterator[BenchRequest]:
    rng = random.Random(seed)
    prefixes = [builder.random_ids(rng, prefix_len) for _ in range(prefix_groups)]
    sent = [builder.as_sent(p) for p in prefixes]  # each prefix as the server tokenizes it, once
    while True:
        group = rng.randrange(prefix_groups) if prefix_groups else None
        ids = (prefixes[group] if group is not None else []) + builder.random_ids(
            rng, input_len.sample(rng)
        )
        prompt, tokens = builder.render_tokens(ids)
        shared = None if group is None else shared_prefix(sent[group], tokens)
        yield BenchRequest(
            prompt=prompt,
            prompt_len=len(tokens),
            output_len=output_len.sample(rng),
            group=group,
            prefix_tokens=shared,
        )


def load_sharegpt(
    path: Path, builder: PromptBuilder, output_len: LengthDist | None, max_prompt_len: int = 1024
) -> list[tuple[str, int, int | None]]:
    """(prompt, prompt tokens, reply tokens or None) for each usable conversation; vLLM's
    filters: prompt and reply of at least 4 tokens, prompt at most `max_prompt_len`."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read ShareGPT file {path}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    out: list[tuple[str, int, int | None]] = []
    for entry in data:
        turns = (
            entry.get("conversations") or entry.get("conversation")
            if isinstance(entry, dict)
            else None
        )
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        texts = [
            t.get("value", t.get("content")) if isinstance(t, dict) else None for t in turns[:2]
        ]
        prompt, reply = texts
        if not (isinstance(prompt, str) and isinstance(reply, str)):
            continue
        n_in = builder.count(prompt)
        n_out = None if output_len else builder.count(reply)
        if n_in < 4 or n_in > max_prompt_len or (n_out is not None and n_out < 4):
            continue
        out.append((prompt, n_in, n_out))
    if not out:
        raise ValueError(
            f"{path}: no usable conversation (need a human turn and a reply, "
            f"4..{max_prompt_len} prompt tokens)"
        )
    return out


def sharegpt(
    entries: list[tuple[str, int, int | None]], output_len: LengthDist | None, seed: int
) -> Iterator[BenchRequest]:
    """Conversations in a seeded random order, reshuffled on every pass (for --duration)."""
    rng = random.Random(seed)
    order = list(range(len(entries)))
    while True:
        rng.shuffle(order)
        for i in order:
            prompt, n_in, n_out = entries[i]
            out = output_len.sample(rng) if output_len else n_out
            assert out is not None
            yield BenchRequest(prompt=prompt, prompt_len=n_in, output_len=out)
