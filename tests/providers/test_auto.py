"""`model: "auto"`: the shipped weights come from the train split alone (refitting with the
test labels scrambled gives the same weights), the classifier is torch-free, and the chooser
follows rank, price, tier and the team's pins and bans."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.backends.providers.auto import AutoPolicy, Classifier, Prediction, choose
from gateway.backends.providers.auto.classifier import LABELS, WEIGHTS
from gateway.backends.providers.auto.dataset import DATA_DIR, load
from gateway.backends.providers.auto.fit import fit
from gateway.backends.providers.catalog import ModelEntry


def test_eval_set_is_large_varied_and_split() -> None:
    rows = load()
    assert len(rows) >= 300 and len({r["id"] for r in rows}) == len(rows)
    for lbl in LABELS:
        split = [r["split"] for r in rows if r["label"] == lbl]
        assert len(split) >= 90 and 0.2 <= split.count("test") / len(split) <= 0.3
    assert len({r["lang"] for r in rows}) >= 8 and len({r["domain"] for r in rows}) >= 20
    assert sum(1 for r in rows if len(r["messages"]) > 1) >= 10


def test_weights_are_fit_on_train_only(tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(DATA_DIR, data)
    for f in data.glob("*.jsonl"):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        for r in rows:
            if r["split"] == "test":  # scramble what the fit must never read
                r["label"] = LABELS[(LABELS.index(r["label"]) + 1) % 3]
                r["messages"] = [{"role": "user", "content": "x"}]
        f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    refit = fit(data, tmp_path / "w.json")
    shipped = Classifier.load(WEIGHTS).weights
    assert (refit.coef, refit.intercept, refit.mean, refit.scale) == (
        shipped.coef,
        shipped.intercept,
        shipped.mean,
        shipped.scale,
    )
    assert refit.fit["l2"] == shipped.fit["l2"] and refit.fit["n_train"] == shipped.fit["n_train"]


def test_classifier_is_torch_free_and_gives_probabilities() -> None:
    code = (
        "import sys\nfrom gateway.backends.providers.auto import AutoRouter\nr = AutoRouter()\np = "
        "r.classifier.predict([{'role': 'user', 'content': "
        "'hello'}])\nprint(sorted(p.probs))\nsys.exit(1 if any(m == 'torch' or "
        "m.startswith('torch.') for m in sys.modules) else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    p = Classifier.load().predict(
        [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    )
    assert set(p.probs) == set(LABELS) and sum(p.probs.values()) == pytest.approx(1)
    assert p.label == max(p.probs, key=p.probs.__getitem__)


CATALOG = {
    m.name: m
    for m in [
        ModelEntry(
            name="small",
            capability_rank=1,
            context_length=2048,
            input_price_per_m=0.05,
            output_price_per_m=0.05,
        ),
        ModelEntry(
            name="mid",
            capability_rank=2,
            context_length=128000,
            input_price_per_m=0.15,
            output_price_per_m=0.6,
            paid=True,
        ),
        ModelEntry(
            name="mid-pricey",
            capability_rank=2,
            context_length=128000,
            input_price_per_m=1,
            output_price_per_m=4,
            paid=True,
        ),
        ModelEntry(
            name="big",
            capability_rank=3,
            context_length=200000,
            input_price_per_m=3,
            output_price_per_m=15,
            tiers=("interactive",),
            paid=True,
        ),
    ]
}


def pred(label: str) -> Prediction:
    return Prediction(label=label, probs={lbl: float(lbl == label) for lbl in LABELS})


def pick(
    label: str,
    policy: AutoPolicy | None = None,
    tier: str = "interactive",
    prompt: int = 100,
    **kw: object,
) -> tuple:
    c = choose(
        pred(label),
        CATALOG,
        tier=tier,
        policy=policy or AutoPolicy(),
        prompt_tokens=prompt,
        max_tokens=None,
        **kw,
    )  # type: ignore[arg-type]
    return c.model, c.reason


def test_cheapest_capable_model_wins() -> None:
    assert pick("simple") == ("small", "cheapest_capable")
    assert pick("medium") == ("mid", "cheapest_capable")
    assert pick("hard") == ("big", "cheapest_capable")
    assert pick("simple", prompt=4000) == (
        "mid",
        "cheapest_capable",
    )  # small's context is too short


def test_team_pins_and_bans() -> None:
    assert pick("simple", AutoPolicy(pin={"simple": "mid-pricey"})) == ("mid-pricey", "pinned")
    assert pick("medium", AutoPolicy(forbid=frozenset({"mid"}))) == (
        "mid-pricey",
        "cheapest_capable",
    )
    assert pick("medium", AutoPolicy(allow=frozenset({"small", "big"}))) == (
        "big",
        "cheapest_capable",
    )
    # a pin the model cannot honour (breaker open) falls back to the normal choice
    assert pick("hard", AutoPolicy(pin={"hard": "mid"}), available=lambda m: m != "mid") == (
        "big",
        "cheapest_capable",
    )


def test_batch_and_best_available() -> None:
    assert pick("hard", tier="batch") == (
        "small",
        "best_available",
    )  # big is interactive only, paid not allowed
    assert pick("hard", AutoPolicy(allow_paid_for_batch=True), tier="batch") == (
        "mid",
        "best_available",
    )
    assert pick("hard", available=lambda m: m == "small") == ("small", "best_available")
    c = choose(
        pred("hard"),
        CATALOG,
        tier="interactive",
        policy=AutoPolicy(forbid=frozenset(CATALOG)),
        prompt_tokens=1,
        max_tokens=None,
    )
    assert (c.model, c.reason) == (None, "none") and len(c.skipped) == len(CATALOG)
