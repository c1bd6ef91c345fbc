"""The docs stay true to the code they describe: every image they show exists, every benchmark
module they name exists, and every command line of the processes whose flags are generated
(`duet up|node|prefill|decode|coordinator|drain`) in their code blocks parses with duet's own
parser without a deprecated flag."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "deploy" / "README.md"]
CHECKED = {"up", "node", "prefill", "decode", "coordinator", "drain"}


def code_lines(text: str) -> list[str]:
    """The lines of the fenced code blocks, backslash continuations joined."""
    out: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        out += block.replace("\\\n", " ").splitlines()
    return out


def commands(path: Path) -> list[list[str]]:
    found = []
    for line in code_lines(path.read_text()):
        try:
            argv = shlex.split(line, comments=True)
        except ValueError:
            continue  # not a shell line (a TOML or JSON example)
        argv = [a for a in argv if a not in ("...", "…")]  # the docs' "and the rest"
        if len(argv) > 1 and argv[0] == "duet" and argv[1] in CHECKED:
            found.append(argv[1:])
    return found


def test_the_docs_show_commands() -> None:
    """The check below sees the docs' commands (a change in their layout would empty it)."""
    assert sum(len(commands(p)) for p in DOCS) >= 10


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_parses_with_current_flags(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from duet import config_flags
    from duet.cli import build_parser

    parser = build_parser()
    for argv in commands(path):
        config_flags._warned.clear()
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{path.name}: duet {shlex.join(argv)} does not parse (exit {e.code})")
        assert "deprecated" not in capsys.readouterr().err, f"{path.name}: {shlex.join(argv)}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_images_and_bench_modules_exist(path: Path) -> None:
    text = path.read_text()
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (path.parent / image).is_file(), f"{path.name}: no image {image}"
    for module in set(re.findall(r"python -m (bench\.[\w.]+|sim\.[\w.]+)", text)):
        assert importlib.util.find_spec(module) is not None, f"{path.name}: no module {module}"
