"""Which NIXL peers a node exchanges KV with before the operator states the KV network
isolated (node/kv_network.py): its own host's addresses only, as the kernel knows them.

The processes across hosts (network namespaces, real NIXL) are in
tests/multihost/test_three_hosts.py; these are the decision's edges.
"""

from __future__ import annotations

import subprocess
import sys

from node.kv_network import FLAG, is_own_address, refusal


def _an_interface_address() -> str | None:
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    addrs = [line.split()[3].split("/")[0] for line in out.splitlines() if " lo " not in line]
    return addrs[0] if addrs else None


def test_own_addresses_are_loopback_and_this_hosts_interfaces() -> None:
    assert is_own_address("127.0.0.1") and is_own_address("127.0.0.2") and is_own_address("::1")
    assert is_own_address("::ffff:127.0.0.1")
    if (mine := _an_interface_address()) is not None:
        assert is_own_address(mine)
    # TEST-NET-1 (RFC 5737) is nobody's; the unspecified address and names are never a peer's.
    for other in ("192.0.2.1", "2001:db8::1", "0.0.0.0", "::", "localhost", ""):
        assert not is_own_address(other), other


def test_only_nixl_off_this_host_without_the_statement_is_refused() -> None:
    assert refusal("127.0.0.1", False, "nixl", "read KV from") is None
    assert refusal("192.0.2.1", True, "nixl", "read KV from") is None
    assert refusal("192.0.2.1", False, "tcp", "read KV from") is None
    assert refusal("192.0.2.1", False, "ucx", "read KV from") is None
    why = refusal("192.0.2.1", False, "nixl", "read KV from")
    assert why is not None and "192.0.2.1" in why and FLAG in why and "--transport tcp" in why


def test_the_flag_explains_the_risk_in_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "duet", "node", "--help"], capture_output=True, text=True
    ).stdout
    text = " ".join(out.split())
    assert FLAG in text and "unauthenticated and unencrypted" in text, text[-2000:]
