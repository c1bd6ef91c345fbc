"""gateway.toml's `kind = "embedding"` models: what the config refuses (no fallback, not in a
fallback chain or auto's candidates, a tokenizer needed) and that auto never picks one."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config

EMB = {"kind": "embedding", "tokenizer": "smollm2-135m-instruct", "input_usd_per_mtok": 0.02}
GEN = {"kind": "cluster", "tokenizer": "smollm2-135m-instruct"}


def test_embedding_model_parses() -> None:
    cfg = parse_config({"models": {"e": EMB, "g": GEN}})
    assert cfg.models["e"].kind == "embedding" and cfg.models["e"].input_usd_per_mtok == 0.02


@pytest.mark.parametrize(
    ("models", "extra", "what"),
    [
        ({"e": {**EMB, "tokenizer": None}}, {}, "needs `tokenizer`"),
        ({"e": {**EMB, "fallback": ["g"]}, "g": GEN}, {}, "no fallback"),
        ({"e": {**EMB, "output_usd_per_mtok": 1.0}}, {}, "no output price"),
        ({"e": EMB, "g": {**GEN, "fallback": ["e"]}}, {}, "fallback names an embedding model"),
        (
            {"e": EMB, "g": GEN},
            {"auto": {"models": ["g", "e"]}},
            "[auto] models names an embedding model",
        ),
        ({"e": {**EMB, "provider": "openai"}}, {}, "provider settings"),
    ],
    ids=["tokenizer", "own-fallback", "output-price", "in-chain", "in-auto", "provider"],
)
def test_refused(models: dict, extra: dict, what: str) -> None:
    models = {n: {k: v for k, v in m.items() if v is not None} for n, m in models.items()}
    with pytest.raises(ConfigError) as e:
        parse_config({"models": models, **extra})
    assert what in str(e.value)


def test_auto_never_holds_an_embedding_model() -> None:
    from gateway.backends.base import ServedModel
    from gateway.backends.embedding import ClusterEmbedder
    from gateway.config import RoutingConfig
    from gateway.serving.choice import ModelChoice
    from gateway.serving.requests import Endpoint

    cfg = parse_config({"models": {"e": EMB, "g": GEN}, "auto": {}})
    emb = ClusterEmbedder(None, None, RoutingConfig(), 576)  # type: ignore[arg-type]  # never called here
    models = {
        "e": ServedModel(cfg.models["e"], emb, None, 8192),
        "g": ServedModel(cfg.models["g"], emb, None, 8192),
    }  # the backend's class is not what auto reads
    choice = ModelChoice(cfg, models)
    assert set(choice.auto_catalog) == {"g"}
    assert emb.usable_for(Endpoint.EMBEDDING, 1) and not emb.usable_for(Endpoint.CHAT, 1)
