"""A TOML table read into a dataclass: how every config file duet reads (the gateway's
`gateway.toml`, `duet up --config cluster.toml`) turns a section into its typed settings.

Invariants: an unknown key is an error that names the table and lists the known keys (a typo
never goes unnoticed); arrays become tuples (the settings dataclasses are frozen and hashable);
a missing or mistyped argument is an error naming the table. The caller's own error type is
raised, so each command reports config mistakes its way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def from_table(
    cls: type[T],
    data: Any,
    where: str,
    error: type[Exception],
    item: Callable[[Any], Any] = lambda x: x,
) -> T:
    """`cls(**data)`; `where` names the table in errors (e.g. "[server]"), `item` converts each
    array element."""
    if not isinstance(data, dict):
        raise error(f"{where} must be a table")
    if not is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise error(
            f"{where} has unknown keys: {', '.join(unknown)} (known: {', '.join(sorted(names))})"
        )
    data = {k: tuple(item(x) for x in v) if isinstance(v, list) else v for k, v in data.items()}
    try:
        return cls(**data)
    except TypeError as e:
        raise error(f"{where}: {e}") from None
