"""Mooncake-style trace replay: one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and optionally `hash_ids` (one id per block of
`block_size` prompt tokens; equal ids mean equal content, so the trace's prefix sharing is
reproduced and a prefix cache sees the same hits).

Invariants: send offsets are (timestamp − first timestamp) × time_scale, in the file's order
sorted by timestamp; a block's tokens are a function of (seed, hash id) only; a bad line is
refused with its line number.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import msgspec

from bench.prompts import PromptBuilder
from bench.workloads import BenchRequest


class TraceEntry(msgspec.Struct, frozen=True, kw_only=True):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int] = []


_DEC = msgspec.json.Decoder(TraceEntry)


def load_trace(path: Path) -> list[TraceEntry]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read trace {path}: {e}") from None
    entries = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = _DEC.decode(line)
        except (msgspec.DecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}:{no}: not a trace entry ({err})") from None
        if entry.input_length < 1 or entry.output_length < 1 or entry.timestamp < 0:
            raise ValueError(f"{path}:{no}: lengths must be positive and the timestamp >= 0")
        entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: the trace is empty")
    return sorted(entries, key=lambda e: e.timestamp)


def replay(
    entries: list[TraceEntry],
    builder: PromptBuilder,
    block_size: int,
    time_scale: float,
    seed: int,
    output_len_override: int | None = None,
) -> Iterator[BenchRequest]:
    t0 = entries[0].timestamp
    blocks: dict[int, list[int]] = {}
    rng = random.Random(seed)
    for e in entries:
        ids: list[int] = []
        for h in e.hash_ids:
            if len(ids) >= e.input_length:
                break
            if h not in blocks:
                blocks[h] = builder.random_ids(random.Random(f"{seed}:{h}"), block_size)
            ids.extend(blocks[h])
        ids = ids[: e.input_length]
        ids.extend(builder.random_ids(rng, e.input_length - len(ids)))
        prompt, n = builder.render(ids)
        yield BenchRequest(
            prompt=prompt,
            prompt_len=n,
            output_len=output_len_override or e.output_length,
            arrival_s=(e.timestamp - t0) / 1e3 * time_scale,
        )
