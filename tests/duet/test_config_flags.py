"""Flags generated from the config dataclasses (duet/config_flags.py): every field of every
class a command shows has exactly one flag with its help, or a reason it has none; the defaults
`--help` shows are the dataclass defaults; no flag given means the dataclass's own values; and
every old spelling still works, with one warning."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import pytest

from duet import cmd_coordinator, cmd_nodes, cmd_up, config_flags
from duet.cli import build_parser
from duet.config_flags import (
    add_config_flags,
    add_deprecated_aliases,
    config_kwargs,
    generated,
    shown_default,
)

COMMANDS = ("node", "prefill", "decode", "coordinator", "up")


def command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def squeeze(text: str) -> str:
    """Help text without its line wrapping (argparse may break a line after a hyphen)."""
    return "".join(text.split())


@pytest.mark.parametrize("name", COMMANDS)
def test_every_field_has_one_flag_with_help_or_a_reason(name: str) -> None:
    p = command(name)
    groups = generated(p)
    shown = {g.cls for g in groups}
    assert len(shown) == len(groups), "a class generated twice"
    by_flag = {s: a for a in p._actions for s in a.option_strings}
    for g in groups:
        for f in dataclasses.fields(g.cls):
            where = f"duet {name}: {g.cls.__name__}.{f.name}"
            if f.name in g.skipped:
                assert f.name not in g.flags and g.skipped[f.name].strip(), where
                # a nested config is a group of its own here (or the shared security flags)
                nested = config_flags._default(f)
                if dataclasses.is_dataclass(nested):
                    assert type(nested) in shown or "shared" in g.skipped[f.name], where
                continue
            action = by_flag[g.flags[f.name]]
            assert action.dest == (g.prefix + f.name).replace("-", "_"), where
            assert f.metadata.get("hidden") or action.help not in (None, argparse.SUPPRESS), where
            docs = config_flags.field_docs(g.cls)[f.name].replace("%", "%%")  # argparse's escape
            assert f.metadata.get("hidden") or docs in (action.help or ""), where
            assert not f.metadata.get("hidden") or action.help == argparse.SUPPRESS, where


@pytest.mark.parametrize("name", COMMANDS)
def test_help_shows_the_dataclass_defaults_and_no_none(name: str) -> None:
    p = command(name)
    text = squeeze(p.format_help())
    assert "(default:None)" not in text
    for g in generated(p):
        for f in dataclasses.fields(g.cls):
            if f.name not in g.flags or f.metadata.get("hidden"):
                continue
            value = g.defaults.get(f.name, config_flags._default(f))
            want = shown_default(value)
            docs = squeeze(config_flags.field_docs(g.cls)[f.name])
            if want is None:
                assert docs in text and squeeze(f"{docs} (default:") not in text, f.name
            else:
                assert squeeze(f"{docs} (default: {want})") in text, f.name


def test_command_defaults_are_the_only_departures_from_the_dataclass() -> None:
    """`duet decode` listens on 8200 and `duet node` on 8300 by default; nothing else of a
    node's settings is defaulted anywhere but in its dataclass."""
    for name, port in (("prefill", 8100), ("decode", 8200), ("node", 8300)):
        defaults = {g.cls.__name__: g.defaults for g in generated(command(name))}
        assert defaults["NodeConfig"] == {"port": port}
        assert not any(d for cls, d in defaults.items() if cls != "NodeConfig")
    assert not any(g.defaults for name in ("coordinator", "up") for g in generated(command(name)))


def test_no_flags_is_the_dataclass_defaults() -> None:
    from coordinator.route_config import PolicyConfig
    from engine.config import EngineConfig
    from node.config import NodeConfig
    from runtime.read_deadlines import ReadDeadlines

    cfg = cmd_nodes.node_config(command("prefill").parse_args([]), "prefill")
    assert dataclasses.replace(cfg, engine=None, security=NodeConfig().security) == NodeConfig(
        role="prefill"
    )
    assert cfg.engine == EngineConfig() and cfg.deadlines == ReadDeadlines()
    args = command("coordinator").parse_args([])
    assert config_kwargs(PolicyConfig, args) == {} and args.planner is None

    up = cmd_up.build_config(command("up").parse_args([]))
    from duet.up_config import UpConfig

    assert up == UpConfig()


def test_flags_set_the_fields() -> None:
    cfg = cmd_nodes.node_config(
        command("node").parse_args(
            [
                "--role",
                "decode",
                "--lease-s",
                "7",
                "--no-prefix-caching",
                "--quantization",
                "int8",
                "--kv-blocks",
                "64",
                "--pool",
                "batch",
            ]
        )
    )
    assert (cfg.role, cfg.lease_s, cfg.pool) == ("decode", 7.0, "batch")
    assert cfg.engine.enable_prefix_caching is False and cfg.engine.quantization == "int8"
    assert cfg.engine.num_kv_blocks == 64
    none = cmd_nodes.node_config(command("node").parse_args(["--quantization", "none"]))
    assert none.engine.quantization is None
    with pytest.raises(SystemExit):
        command("node").parse_args(["--pool", "elsewhere"])


#: every deprecated alias, with a value, as (command, old argv, new argv)
ALIASES = [
    *[("node", [old, "3"], [new, "3"]) for old, new in cmd_nodes.DEPRECATED.items()],
    ("coordinator", ["--ttl", "4"], ["--ttl-s", "4"]),
    ("coordinator", ["--actuator", "local"], ["--planner-set", "actuator=local"]),
    ("coordinator", ["--decision-file", "d.json"], ["--planner-set", "decision_file=d.json"]),
    ("coordinator", ["--k8s-namespace", "ns"], ["--planner-set", "k8s_namespace=ns"]),
    (
        "coordinator",
        ["--k8s-deployment", "decode/batch=x"],
        ["--planner-set", "k8s_deployments.decode/batch=x"],
    ),
    (
        "coordinator",
        ["--local-control", "http://h:1"],
        ["--planner-set", "local_control=http://h:1"],
    ),
    ("coordinator", ["--node-budget", "6"], ["--planner-set", "node_budget=6"]),
    ("coordinator", ["--planner-profile", "p.json"], ["--planner-set", "profile=p.json"]),
    ("coordinator", ["--drain-deadline-s", "9"], ["--planner-set", "drain_deadline_s=9"]),
    ("drain", ["n1", "--timeout", "5"], ["n1", "--timeout-s", "5"]),
    *[("up", [old, "2"], [new, "2"]) for old, new in cmd_up.DEPRECATED.items()],
]


def test_every_alias_is_tested() -> None:
    tested = {argv[0] if argv[0] != "n1" else argv[1] for _, argv, _ in ALIASES}
    assert tested == {
        *cmd_nodes.DEPRECATED,
        *cmd_coordinator.DEPRECATED,
        *cmd_up.DEPRECATED,
        "--timeout",
    }


@pytest.mark.parametrize(("name", "old", "new"), ALIASES, ids=lambda x: str(x))
def test_an_old_flag_works_as_its_new_one_and_warns_once(
    name: str, old: list[str], new: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    config_flags._warned.clear()
    p = command(name)
    assert vars(p.parse_args(old)) == vars(p.parse_args(new))
    flag = next(a for a in old if a.startswith("--"))
    assert capsys.readouterr().err.count(f"{flag} is deprecated") == 1
    p.parse_args(old)
    assert "deprecated" not in capsys.readouterr().err
    assert flag not in p.format_help().split()  # hidden from --help


def test_the_planner_aliases_reach_the_planner_config() -> None:
    from planner.config import load_config

    args = command("coordinator").parse_args(
        ["--actuator", "kubernetes", "--k8s-deployment", "decode=dx", "--node-budget", "3"]
    )
    cfg = load_config(None, args.planner_set)
    assert (cfg.actuator, cfg.k8s_deployments, cfg.node_budget) == (
        "kubernetes",
        {"decode": "dx"},
        3,
    )


# -- the generator's own rules, on classes made for them ----------------------------------------


@dataclass
class _Sample:
    #: a count
    count: int = 3
    #: a mode
    mode: Literal["a", "b"] = "a"
    #: an optional mode
    maybe: Literal["x", "y"] | None = None
    #: on unless turned off
    enable_thing: bool = True
    #: off unless turned on
    loud: bool = False
    #: repeatable
    items: tuple[str, ...] = ()
    #: a timeout
    wait_s: float = 1.5
    #: renamed
    long_name: str = field(default="v", metadata={"flag": "short"})


def test_the_generator_reads_names_types_and_choices() -> None:
    p = argparse.ArgumentParser()
    add_config_flags(p.add_argument_group("sample"), _Sample)
    assert config_kwargs(_Sample, p.parse_args([])) == {}
    args = p.parse_args(
        ["--count", "4", "--mode", "b", "--maybe", "none", "--no-thing", "--loud"]
        + ["--items", "p", "--items", "q", "--wait-s", "2", "--short", "w"]
    )
    assert _Sample(**config_kwargs(_Sample, args)) == _Sample(
        count=4,
        mode="b",
        maybe=None,
        enable_thing=False,
        loud=True,
        items=("p", "q"),
        wait_s=2.0,
        long_name="w",
    )
    assert config_kwargs(_Sample, p.parse_args(["--maybe", "y"]))["maybe"] == "y"
    for bad in (["--mode", "c"], ["--count", "x"], ["--maybe", "z"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    help_text = squeeze(p.format_help())
    assert squeeze("a timeout (default: 1.5)") in help_text and "--wait-sS" in help_text
    assert squeeze("on unless turned off (default: on)") in help_text


def test_a_field_without_help_or_flag_form_stops_the_parser() -> None:
    @dataclass
    class Undocumented:
        size: int = 1

    @dataclass
    class Table:
        #: a table has no flag form
        table: dict[str, int] = field(default_factory=dict)

    for cls in (Undocumented, Table):
        with pytest.raises(TypeError, match="skip it with a reason"):
            add_config_flags(argparse.ArgumentParser().add_argument_group("x"), cls)
    group = argparse.ArgumentParser().add_argument_group("x")
    add_config_flags(group, Table, skip={"table": "a file's"})


def test_a_value_alias_hands_its_text_on() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--set", action="append", default=[])
    add_deprecated_aliases(p, {"--old": "--set key="})
    assert p.parse_args(["--old", "v", "--set", "w=1"]).set == ["key=v", "w=1"]
