"""The CLI's one error type, below every command module: each raises it where an operator's
mistake is found, and `duet/cli.py` prints it in one line and exits 2."""

from __future__ import annotations


class UsageError(Exception):
    """An operator mistake worth a one-line message and exit code 2."""
