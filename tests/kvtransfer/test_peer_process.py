"""The test harness's peer process starts with any cluster secret, and says why when it cannot.

A secret from `secrets.token_urlsafe` starts with "-" once in 64 draws; passed as its own argv
word, argparse took it for an option and the peer exited before READY, which surfaced as an
unrelated error in whichever test drew it.
"""

from __future__ import annotations

import pytest

from tests.kvtransfer.procs import PeerProcess


def test_a_secret_that_starts_with_a_dash_still_starts_the_peer() -> None:
    proc = PeerProcess("tcp", "P-dash", 1, secret="-" + "s" * 40)
    try:
        assert proc.port > 0
        assert proc.proc.poll() is None
    finally:
        proc.stop()


def test_a_peer_that_cannot_start_reports_its_stderr() -> None:
    with pytest.raises(RuntimeError, match="unknown kv transfer backend"):
        PeerProcess("no-such-backend", "P-bad", 1)
