"""PeerPolicy: which addresses a decode node may contact, per engine id."""

from __future__ import annotations

import pytest

from node.config import DEFAULT_ALLOWED_PEERS, NodeConfig, parse_networks
from node.peers import PeerPolicy


def policy(spec: str = DEFAULT_ALLOWED_PEERS, **kw: int) -> PeerPolicy:
    return PeerPolicy(parse_networks(spec), **kw)


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("10.1.2.3", True),
        ("172.20.0.1", True),
        ("192.168.1.5", True),
        ("fd00::5", True),
        ("169.254.169.254", False),
        ("8.8.8.8", False),
        ("172.32.0.1", False),
        ("2001:db8::1", False),
        ("fe80::1", False),
        ("0.0.0.0", False),
        ("localhost", False),
        ("", False),
    ],
)
def test_default_networks(host: str, ok: bool) -> None:
    assert (policy().allowed(host, 8100, "e") is None) is ok


def test_ports_and_operator_networks() -> None:
    p = policy("10.0.0.0/8")
    assert "outside" in p.allowed("127.0.0.1", 8100, "e")
    assert p.allowed("10.9.9.9", 8100, "e") is None
    for port in (0, -1, 65536):
        assert "not a TCP port" in p.allowed("10.9.9.9", port, "e")
    with pytest.raises(ValueError, match="cannot read peer network"):
        parse_networks("10.0.0.0/33")
    with pytest.raises(ValueError, match="peer network"):
        NodeConfig(allowed_peers="nonsense")


def test_engine_ids_are_pinned_to_their_first_address_and_the_pins_are_bounded() -> None:
    p = policy(max_pinned=2)
    p.pin("a", "127.0.0.1", 8100)
    assert p.allowed("127.0.0.1", 8100, "a") is None
    assert "is at 127.0.0.1:8100" in p.allowed("127.0.0.1", 8101, "a")
    assert "is at" in p.allowed("10.0.0.1", 8100, "a")
    p.pin("b", "127.0.0.1", 1)
    p.pin("c", "127.0.0.1", 2)  # "a" is the least recently pinned: forgotten
    assert p.allowed("10.0.0.1", 8100, "a") is None
    p.forget("b")
    assert p.allowed("10.0.0.1", 9, "b") is None


async def test_resolve() -> None:
    p = policy()
    assert await p.resolve("10.0.0.1") == ["10.0.0.1"]
    assert "127.0.0.1" in await p.resolve("localhost")
    assert await p.resolve("no-such-host.invalid") == []
    assert await p.resolve("x" * 300) == []


async def test_a_published_transport_address_must_be_allowed_and_on_the_named_host() -> None:
    """The transport address in a peer's metadata is the peer's word."""
    from node.peers import PeerRefused

    p = policy("127.0.0.0/8")
    assert await p.transport_address("127.0.0.2", ("127.0.0.2",)) == "127.0.0.2"
    with pytest.raises(PeerRefused, match="not the host it was named by"):
        await p.transport_address("127.0.0.3", ("127.0.0.2",))
    with pytest.raises(PeerRefused, match="outside this node's allowed peer networks"):
        await p.transport_address("10.0.0.1", ("10.0.0.1",))
    with pytest.raises(PeerRefused, match="does not resolve"):
        await p.transport_address("no-such-host.invalid", ("127.0.0.2",))
    # A name is resolved once, and the address checked is the one connected to.
    assert await p.transport_address("localhost", ("127.0.0.1", "::1")) in ("127.0.0.1", "::1")


def test_cluster_members_are_the_registered_prefill_capable_nodes() -> None:
    from node.members import ClusterMembers
    from protocol.cluster import NodeInfo

    def info(node_id: str, role: str, url: str) -> NodeInfo:
        return NodeInfo(
            node_id=node_id,
            role=role,
            url=url,
            model="m",
            engine_id=f"e-{node_id}",  # type: ignore[arg-type]
            block_size=16,
            kv_layout_hash="h",
            kv_capacity_blocks=1,
            max_model_len=1,
            started_at=0.0,
        )

    m = ClusterMembers()
    assert not m.listed and m.kv_source("e-p") is None
    m.sync(
        {
            "p": info("p", "prefill", "http://10.0.0.5:8200"),
            "d": info("d", "decode", "http://10.0.0.6:8300"),
        }
    )
    assert m.listed and m.kv_source("e-p") == ("10.0.0.5", 8200)
    assert m.kv_source("e-d") is None  # a decode node serves no KV
    m.put(info("b", "both", "http://[fd00::7]:8400"))
    assert m.kv_source("e-b") == ("fd00::7", 8400)
    assert m.kv_hosts() == {"10.0.0.5", "fd00::7"}
    m.put(info("p", "prefill", "http://10.0.0.9:8200"))  # re-registered elsewhere: the new address
    assert m.kv_source("e-p") == ("10.0.0.9", 8200)
    m.delete("p")
    assert m.kv_source("e-p") is None
    m.sync({})
    assert m.kv_source("e-b") is None
