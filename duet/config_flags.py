"""Command-line flags generated from config dataclasses, as vLLM's `engine/arg_utils.py` does
with `get_kwargs(ModelConfig)`: the dataclass is the one source of a setting's name, type,
default and help, and a field added to it is a flag of every command that shows its class.

Per field:
- **flag**: `--` + the group's prefix + the field's name with dashes (`lease_s` → `--lease-s`);
  a bool named `enable_X` is `--X` / `--no-X`. `field(metadata={"flag": NAME})` keeps a name
  operators already type (`engine_kind` → `--engine`); `"metavar"` and `"hidden"` likewise.
- **help**: the `#:` comment lines just above the field (Sphinx's attribute-doc convention),
  then "(default: X)" from the field's default — not for a default of None, False or empty,
  whose meaning the comment says in words.
- **type** from the annotation: int, float, str (a union holding str is a str); `X | None` may
  stay unset; `Literal[...]` gives the choices (an optional one also takes "none" for None);
  bool is `--x` (default off) or `--x` / `--no-x` (default on); `tuple[str, ...]` repeats.
- **default**: argparse keeps none of its own (None: not given) unless a command sets one
  (`defaults=`, e.g. `duet decode`'s port). `config_kwargs` returns the flags given and the
  dataclass fills in the rest, so every default is written once, in the dataclass.
- A field that is no flag is skipped with its reason (`skip={field: why}`). A field whose type
  has no flag form and no reason stops the parser's construction: no setting goes missing
  from the command line unnoticed.

Old spellings: `add_deprecated_aliases(parser, {old: new})` makes `old` do what `new` does
and print one warning per process.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

#: what an optional choice field takes on the command line for None (`--quantization none`)
NONE = "none"


@dataclasses.dataclass(frozen=True)
class FlagKind:
    """How a field reads from the command line (from its annotation)."""

    type: Callable[[str], Any] | None
    choices: tuple[str, ...] | None = None
    #: argparse's action: "store", "store_true", "append" or BooleanOptionalAction
    action: Any = "store"


@dataclasses.dataclass(frozen=True)
class Generated:
    """What `add_config_flags` made of one class on one parser (read by tests and docs)."""

    cls: type
    prefix: str
    #: field name → its flag
    flags: dict[str, str]
    #: field name → why it has no flag
    skipped: dict[str, str]
    #: field name → the default this command shows instead of the dataclass's
    defaults: dict[str, Any]


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name → its `#:` comment, the comment lines just above it joined into one."""
    lines, _ = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    klass = tree.body[0]
    assert isinstance(klass, ast.ClassDef)
    docs: dict[str, str] = {}
    for stmt in klass.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            above: list[str] = []
            i = stmt.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#:"):
                above.insert(0, lines[i].strip()[2:].strip())
                i -= 1
            if above:
                docs[stmt.target.id] = " ".join(above)
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def flag_kind(hint: Any, default: Any) -> FlagKind | None:
    """The flag form of an annotation, or None when it has none (a nested config, a table)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = str if str in members else members[0] if len(members) == 1 else None
        optional = True
    else:
        optional = False
    origin = typing.get_origin(hint)
    if hint is bool:
        return FlagKind(None, action=argparse.BooleanOptionalAction if default else "store_true")
    if hint in (int, float, str):
        return FlagKind(hint)
    if origin is Literal:
        choices = tuple(str(c) for c in typing.get_args(hint))
        return FlagKind(str, (*choices, NONE) if optional else choices)
    if origin is tuple and typing.get_args(hint)[1:] == (Ellipsis,):
        return FlagKind(typing.get_args(hint)[0], action="append")
    return None


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def flag_name(f: dataclasses.Field[Any], prefix: str = "") -> str:
    name = f.metadata.get("flag") or f.name.removeprefix("enable_").replace("_", "-")
    return f"--{prefix}{name}"


def shown_default(value: Any) -> str | None:
    """The "(default: X)" text of a default; None where the help's words say it."""
    if value is None or value is False or value in ((), [], "") or value is dataclasses.MISSING:
        return None
    if value is True:
        return "on"
    return str(value)


def _metavar(f: dataclasses.Field[Any], kind: FlagKind) -> str | None:
    if "metavar" in f.metadata:
        return f.metadata["metavar"]
    if kind.choices or kind.action not in ("store", "append"):
        return None
    if f.name.endswith("_s") and kind.type is float:
        return "S"
    if f.name.endswith("_ms"):
        return "MS"
    if kind.type is int:
        return "N"
    return "X" if kind.type is float else None


def add_config_flags(
    group: argparse._ArgumentGroup,
    cls: type,
    *,
    prefix: str = "",
    skip: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """The flags of `cls`'s fields, in `group` (one argument group per class; see the module
    docstring for the rules)."""
    skip, defaults = dict(skip or {}), dict(defaults or {})
    docs, hints = field_docs(cls), _hints(cls)
    flags: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = defaults.get(f.name, _default(f))
        kind = flag_kind(hints[f.name], default)
        if kind is None or f.name not in docs:
            why = "no flag form for its type" if kind is None else "no `#:` help comment"
            raise TypeError(
                f"{cls.__name__}.{f.name}: {why}; document it, or skip it with a reason"
            )
        flag = flag_name(f, prefix)
        shown = shown_default(default)
        text = docs[f.name] + (f" (default: {shown})" if shown is not None else "")
        kwargs: dict[str, Any] = {
            "dest": (prefix + f.name).replace("-", "_"),
            "action": kind.action,
            "default": defaults.get(f.name),
            "help": argparse.SUPPRESS if f.metadata.get("hidden") else text.replace("%", "%%"),
        }
        if kind.action in ("store", "append"):
            kwargs.update(type=kind.type, choices=kind.choices, metavar=_metavar(f, kind))
        group.add_argument(flag, **kwargs)
        flags[f.name] = flag
    group.__dict__.setdefault(_REGISTRY, []).append(Generated(cls, prefix, flags, skip, defaults))


#: where a group keeps what `add_config_flags` made in it
_REGISTRY = "_duet_config_flags"


def generated(parser: argparse.ArgumentParser) -> list[Generated]:
    """Every class `add_config_flags` put on this parser, in order (read by tests and docs)."""
    return [g for group in parser._action_groups for g in group.__dict__.get(_REGISTRY, [])]


def config_kwargs(cls: type, args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """The fields of `cls` whose flags were given (or have a command's default), for
    `cls(**kwargs)` or `dataclasses.replace(obj, **kwargs)`."""
    hints, out = _hints(cls), {}
    for f in dataclasses.fields(cls):
        value = getattr(args, (prefix + f.name).replace("-", "_"), None)
        if value is None:
            continue
        kind = flag_kind(hints[f.name], _default(f))
        if kind is not None and kind.choices and NONE in kind.choices and value == NONE:
            value = None
        out[f.name] = tuple(value) if isinstance(value, list) else value
    return out


_warned: set[str] = set()


class _DeprecatedAlias(argparse.Action):
    """An old spelling: warns once per process, then acts as the flag it became. A `new` with a
    space (`--planner-set actuator=`) hands that flag the old flag's value after the text."""

    def __init__(self, option_strings: list[str], dest: str, *, target: argparse.Action, new: str):
        # argparse may also name a type by a string it registered; duet's flags give callables
        convert = None if isinstance(target.type, str) else target.type
        super().__init__(
            option_strings,
            dest,
            nargs=target.nargs,
            type=convert if " " not in new else None,
            choices=target.choices if " " not in new else None,
            default=argparse.SUPPRESS,
            metavar=target.metavar,
            help=argparse.SUPPRESS,
        )
        self.target, self.new, self.convert = target, new, convert

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        flag, _, head = self.new.partition(" ")
        if option_string not in _warned:
            _warned.add(option_string or "")
            print(f"duet: {option_string} is deprecated, use {self.new}", file=sys.stderr)
        if head:
            values = head + values
            values = self.convert(values) if self.convert else values
        self.target(parser, namespace, values, flag)


def add_deprecated_aliases(parser: argparse.ArgumentParser, aliases: Mapping[str, str]) -> None:
    """Each old flag of `aliases` does what its new one does (hidden from --help, warned once)."""
    actions = {s: a for a in parser._actions for s in a.option_strings}
    for old, new in aliases.items():
        target = actions[new.partition(" ")[0]]
        parser.add_argument(old, dest=target.dest, action=_DeprecatedAlias, target=target, new=new)
