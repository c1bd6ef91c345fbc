"""`duet up` with embedding nodes: a `role = "embed"` group (or `--embed MODEL`) starts
`duet node --role both --task embed`, and the gateway.toml it writes serves that model as
kind = "embedding" — under its own name, or NAME-embed beside generation nodes of the model."""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import replace

import pytest

from duet.cmd_up import add_parser, build_config, gateway_toml
from duet.up_config import GatewaySection, NodeGroup, UpConfig, UpConfigError, parse_cluster_toml
from gateway.config import parse_config


def _toml(cfg: UpConfig, served: dict[str, str], nodes: list[tuple[str, str, str]]):
    return parse_config(
        tomllib.loads(
            gateway_toml(cfg, "sqlite:///x.db", "ab" * 32, ["http://127.0.0.1:9"], served, nodes)
        )
    )


def test_embed_group_beside_generation_of_the_same_model() -> None:
    cfg = parse_cluster_toml(
        {"model": "/m/tiny", "nodes": [{"role": "both"}, {"role": "embed", "pooling": "mean"}]},
        UpConfig(),
    )
    assert (
        cfg.generation_models() == cfg.embedding_models() == ["/m/tiny"]
        and "1 embedding" in cfg.describe()
    )
    nodes = [("/m/tiny", "both", "http://127.0.0.1:1"), ("/m/tiny", "embed", "http://127.0.0.1:2")]
    gw = _toml(cfg, {"/m/tiny": "tiny"}, nodes)
    assert gw.models["tiny"].kind == "cluster" and gw.models["tiny-embed"].kind == "embedding"
    assert (
        gw.models["tiny-embed"].cluster_name == "tiny"
        and gw.models["tiny-embed"].tokenizer == "/m/tiny"
    )
    static = _toml(
        replace(cfg, gateway=GatewaySection(routing="static")), {"/m/tiny": "tiny"}, nodes
    )
    assert static.models["tiny-embed"].static.both == ("http://127.0.0.1:2",)
    assert static.models["tiny"].static.both == ("http://127.0.0.1:1",)


def test_embedding_only_model_keeps_its_name_and_needs_no_decode_node() -> None:
    cfg = parse_cluster_toml(
        {"model": "/m/tiny", "nodes": [{"role": "both"}, {"role": "embed", "model": "/m/qe"}]},
        UpConfig(),
    )
    gw = _toml(cfg, {"/m/tiny": "tiny", "/m/qe": "qe"}, [])
    assert (
        gw.models["qe"].kind == "embedding"
        and "qe-embed" not in gw.models
        and gw.models["tiny"].kind == "cluster"
    )
    with pytest.raises(UpConfigError, match="pooling"):
        parse_cluster_toml({"nodes": [{"role": "both", "pooling": "mean"}]}, UpConfig())
    with pytest.raises(UpConfigError, match="pooling"):
        parse_cluster_toml(
            {"nodes": [{"role": "both"}, {"role": "embed", "pooling": "max"}]}, UpConfig()
        )


def test_embed_flag_adds_one_embed_group() -> None:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    cfg = build_config(p.parse_args(["up", "--colocated", "--embed", "smollm2-135m-instruct"]))
    assert cfg.nodes[-1] == NodeGroup(role="embed", model="smollm2-135m-instruct")
    assert (
        build_config(p.parse_args(["up"])).embedding_models() == []
    )  # the default layout is unchanged
