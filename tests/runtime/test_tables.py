"""runtime/tables.py: a TOML table into a settings dataclass, with errors that name the table."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from runtime.tables import from_table


class BadConfig(Exception):
    pass


@dataclass(frozen=True)
class Section:
    port: int
    hosts: tuple[str, ...] = ()


def test_a_table_becomes_the_dataclass_with_arrays_as_tuples() -> None:
    assert from_table(Section, {"port": 1, "hosts": ["a", "b"]}, "[s]", BadConfig) == Section(
        1, ("a", "b")
    )
    assert from_table(Section, {"port": 1, "hosts": [1, 2]}, "[s]", BadConfig, item=str).hosts == (
        "1",
        "2",
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"port": 1, "prot": 2}, "[s] has unknown keys: prot (known: hosts, port)"),
        ([1, 2], "[s] must be a table"),
        ({"hosts": []}, "[s]: "),  # the missing argument, in the dataclass's words
    ],
)
def test_mistakes_are_the_callers_error_naming_the_table(data: object, message: str) -> None:
    with pytest.raises(BadConfig) as e:
        from_table(Section, data, "[s]", BadConfig)
    assert str(e.value).startswith(message)
