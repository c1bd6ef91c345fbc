"""The routing policy with LoRA adapters and sleeping nodes (pure, exact): an adapter's request
goes to nodes with LoRA slots, prefers those that hold the adapter, spreads to another node (which
then must load it) when the holders are loaded past the load's cost; a sleeping node costs its
wake; a model served by no LoRA-capable node is a 404 that says so."""

from __future__ import annotations

import msgspec
import pytest

from coordinator.nodes import NodeView
from protocol.openai import APIError
from tests.coordinator.test_policy import req, route, view


def lora_view(node_id: str, role: str, adapters: list[str], slots: int = 4, **kw) -> NodeView:
    v = view(node_id, role, **kw)
    v.info = msgspec.structs.replace(v.info, max_loras=slots)
    v.load = msgspec.structs.replace(v.load, lora_adapters=adapters)
    return v


def test_an_adapter_goes_to_the_node_that_holds_it() -> None:
    views = [lora_view("a", "both", []), lora_view("b", "both", ["sql"])]
    d = route(views, req(100, lora_name="sql"))
    assert d.response.decode.node_id == "b" and d.lora_loads == []
    base = route(views, req(100))  # the base model: the lower id on a tie, no load
    assert base.response.decode.node_id == "a" and base.lora_loads == []


def test_a_busy_holder_spreads_the_adapter_to_another_node() -> None:
    views = [lora_view("a", "both", []), lora_view("b", "both", ["sql"], running=20)]
    d = route(views, req(100, lora_name="sql"))
    assert d.response.decode.node_id == "a" and d.lora_loads == ["a"]
    # below the load's cost, the holder keeps it
    views[1] = lora_view("b", "both", ["sql"], running=10)
    assert route(views, req(100, lora_name="sql")).response.decode.node_id == "b"


def test_pd_pair_both_need_the_adapter() -> None:
    views = [
        lora_view("p", "prefill", []),
        lora_view("d", "decode", ["sql"]),
    ]
    d = route(views, req(2000, lora_name="sql"))
    assert d.response.prefill is not None and d.response.prefill.node_id == "p"
    assert d.lora_loads == ["p"]


def test_nodes_without_slots_never_take_an_adapter() -> None:
    views = [view("plain", "both"), lora_view("lora", "both", [], running=50)]
    assert route(views, req(100, lora_name="sql")).response.decode.node_id == "lora"
    with pytest.raises(APIError, match="serves LoRA adapters") as e:
        route([view("plain", "both")], req(100, lora_name="sql"))
    assert e.value.status == 404


def test_a_sleeping_node_costs_its_wake() -> None:
    asleep = view("a", "both")
    asleep.load = msgspec.structs.replace(asleep.load, sleeping=True)
    assert route([asleep, view("b", "both", running=50)], req(100)).response.decode.node_id == "b"
    assert route([asleep, view("b", "both", running=200)], req(100)).response.decode.node_id == "a"
