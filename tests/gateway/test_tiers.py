"""Tier admission, exactly: a freed slot goes to interactive before batch, batch is shed first
when saturated, bounded queues and waits give 503s, and no slot leaks on cancellation."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.config import TierConfig
from gateway.metrics import GatewayMetrics
from gateway.serving.tiers import Admission, Shed
from tests.gateway.helpers import MODEL, http, make_team, metric
from tests.procs import Proc
from tests.wait import until


def admission(**kw: object) -> Admission:
    cfg = TierConfig(
        **{
            "max_inflight": 1,
            "interactive_queue": 2,
            "batch_queue": 1,
            "interactive_max_wait_s": 5.0,
            "batch_max_wait_s": 5.0,
            **kw,
        }
    )  # type: ignore[arg-type]
    return Admission(cfg, GatewayMetrics())


async def _hold(
    a: Admission, tier: str, order: list[str], name: str, release: asyncio.Event
) -> None:
    async with a.slot(tier):
        order.append(name)
        await release.wait()


async def test_interactive_goes_first_and_batch_is_shed_first() -> None:
    a = admission()
    order: list[str] = []
    gates = {n: asyncio.Event() for n in ("first", "batch", "inter")}
    first = asyncio.ensure_future(_hold(a, "interactive", order, "first", gates["first"]))
    await until(lambda: order == ["first"])
    batch = asyncio.ensure_future(_hold(a, "batch", order, "batch", gates["batch"]))
    await until(lambda: a.depth("batch") == 1)
    inter = asyncio.ensure_future(_hold(a, "interactive", order, "inter", gates["inter"]))
    await until(lambda: a.depth("interactive") == 1)
    assert order == ["first"]
    # saturated with interactive traffic waiting: a new batch request is shed at once
    with pytest.raises(Shed) as e:
        async with a.slot("batch"):
            pass
    assert e.value.status == 503 and e.value.retry_after_s > 0
    gates["first"].set()
    await first
    await until(lambda: len(order) == 2)
    assert order == ["first", "inter"]  # the interactive request overtook the older batch one
    gates["inter"].set()
    await inter
    await until(lambda: len(order) == 3)
    assert order == ["first", "inter", "batch"]
    gates["batch"].set()
    await batch
    assert a.running == 0


async def test_full_queue_and_max_wait() -> None:
    a = admission(interactive_max_wait_s=0.2)
    release = asyncio.Event()
    holder = asyncio.ensure_future(_hold(a, "interactive", [], "h", release))
    await until(lambda: a.running == 1)
    waiters = [
        asyncio.ensure_future(_hold(a, "interactive", [], f"w{i}", release)) for i in range(2)
    ]
    await until(lambda: a.depth("interactive") == 2)
    with pytest.raises(Shed, match="queue is full"):
        async with a.slot("interactive"):
            pass
    for w in waiters:  # nobody freed a slot within 0.2 s
        with pytest.raises(Shed, match="no capacity freed"):
            await w
    release.set()
    await holder
    assert a.running == 0 and a.depth("interactive") == 0


async def test_cancelled_waiter_leaks_nothing() -> None:
    a = admission()
    release = asyncio.Event()
    holder = asyncio.ensure_future(_hold(a, "interactive", [], "h", release))
    await until(lambda: a.running == 1)
    waiter = asyncio.ensure_future(_hold(a, "interactive", [], "w", release))
    await until(lambda: a.depth("interactive") == 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    release.set()
    await holder
    assert a.running == 0 and a.depth("interactive") == 0
    async with a.slot("batch"):  # capacity is all there
        assert a.running == 1


async def test_saturated_gateway_sheds_batch_first(one_slot_gateway: Proc) -> None:
    """Through a real gateway (one slot): while an interactive request waits, a batch request is
    refused at once with 503 + Retry-After; the waiting interactive one is served."""
    g = one_slot_gateway
    key = make_team(g.url, "t")
    auth = {"Authorization": f"Bearer {key}"}
    long = {
        "model": MODEL,
        "prompt": "hold the slot",
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as s:
        holder = await s.post(g.url + "/v1/completions", json=long, headers=auth)
        assert holder.status == 200
        waiting = asyncio.ensure_future(
            s.post(
                g.url + "/v1/completions",
                headers=auth,
                json={"model": MODEL, "prompt": "next", "max_tokens": 2},
            )
        )
        await until(
            lambda: http(g.url + "/health")[2]["waiting"]["interactive"] == 1,
            timeout=60,
        )
        async with s.post(
            g.url + "/v1/completions",
            headers={**auth, "x-duet-tier": "batch"},
            json={"model": MODEL, "prompt": "batch", "max_tokens": 2},
        ) as r:
            err = await r.json()
            assert (
                r.status == 503
                and err["error"]["code"] == "overloaded"
                and int(r.headers["Retry-After"]) >= 1
            )
        assert metric(g.url, "duet:gateway_queue_depth") == 1
        async for _ in holder.content:
            pass
        holder.close()
        served = await waiting
        assert served.status == 200
        served.close()
    assert metric(g.url, "duet:gateway_shed_total") == 1
