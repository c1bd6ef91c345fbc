"""The labelled router evaluation set (data/router_eval/*.jsonl): one JSON object a line with
`id`, `label` (simple | medium | hard), `split` (train | test, fixed in the file), `domain`,
`lang` and `messages` (an OpenAI chat request's messages)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parents[4] / "data" / "router_eval"


def load(data_dir: Path = DATA_DIR) -> list[dict[str, Any]]:
    rows = []
    for f in sorted(data_dir.glob("*.jsonl")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            r = json.loads(line)
            if (
                r.get("label") not in ("simple", "medium", "hard")
                or r.get("split") not in ("train", "test")
                or not isinstance(r.get("messages"), list)
            ):
                raise ValueError(f"{f}:{n}: needs label, split and messages")
            rows.append(r)
    if not rows:
        raise FileNotFoundError(f"no *.jsonl in {data_dir}")
    return rows


def digest(data_dir: Path = DATA_DIR) -> str:
    h = hashlib.sha256()
    for f in sorted(data_dir.glob("*.jsonl")):
        h.update(f.read_bytes())
    return h.hexdigest()
