"""A simulated cluster: the gateway's real tier admission (gateway/serving/tiers.py), the real
coordinator routing policy (coordinator/policy.py) over real NodeViews and the real prefix
index, and SimNodes (real scheduler and block pool) — on virtual time.

The life of a request mirrors DESIGN §1: admission slot (interactive/batch queues, shedding)
→ gateway + route overhead → Router.route (pending decisions added as the coordinator does)
→ local prefill on D, or: P prefills and holds its blocks → the P→D hop → D reserves blocks
(WAITING_FOR_REMOTE_KV) → the transfer lasts latency + bytes/bandwidth → P releases, D marks
the KV ready and recomputes the last prompt token → D decodes and streams.

HTTP and the processes' own CPU come from the profile's overheads: fixed wall times per request
(gateway + route + leg, the P→D hop, a token's relay) and, on a node that streams, its event
loop's CPU per token beside the engine step (sim/node.py).

What is *not* simulated (each a stated assumption in the result): the gateway's CPU as load
on the nodes' cores (the run's contention carries it); load-frame transport delay (frames reach the
coordinator the instant they are taken, every LOAD_INTERVAL_S, and KV events right after the
step that produced them); failures, retries, migrations and lease expiry.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from coordinator.index import PrefixIndex
from coordinator.nodes import NodeView
from coordinator.policy import Router
from coordinator.route_config import PolicyConfig
from engine.request import Request
from gateway.config import TierConfig
from gateway.metrics import GatewayMetrics
from gateway.serving.tiers import Admission, Shed
from protocol.block_hash import block_hashes
from protocol.cluster import NodeInfo, Role
from protocol.kv_events import LOAD_INTERVAL_S
from protocol.openai import APIError
from protocol.route import RouteRequest
from protocol.sampling import Priority, SamplingParams
from sim.early import EarlyStop
from sim.host import SharedHost
from sim.jitter import StepJitter
from sim.node import SimNode, apply_events
from sim.profile import Profile
from sim.stats import Collector, RequestResult
from sim.workload import WorkItem

MODEL = "sim-model"


@dataclass(frozen=True)
class NodeGroup:
    role: Role
    count: int
    pool: str = "shared"


@dataclass(frozen=True)
class Layout:
    groups: tuple[NodeGroup, ...]
    max_num_seqs: int | None = None  # None: the profile's
    max_num_batched_tokens: int | None = None
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    #: every node on one machine (a CPU cluster like sim.validate's): steps that overlap are
    #: stretched by the profile's co-run factors (sim/host.py)
    one_host: bool = False

    @property
    def num_nodes(self) -> int:
        return sum(g.count for g in self.groups)

    def label(self) -> str:
        parts = [
            f"{g.count}{ {'both': 'C', 'prefill': 'P', 'decode': 'D'}[g.role] }"
            for g in self.groups
        ]
        extra = []
        if self.max_num_seqs:
            extra.append(f"seqs={self.max_num_seqs}")
        if self.max_num_batched_tokens:
            extra.append(f"chunk={self.max_num_batched_tokens}")
        return "+".join(parts) + (f" ({', '.join(extra)})" if extra else "")


class SimCluster:
    def __init__(
        self, profile: Profile, layout: Layout, *, step_jitter: float = 0.0, seed: int = 0
    ) -> None:
        """`step_jitter`: sigma of each step's lognormal noise (sim/jitter.py; 0: none), per
        node seeded from `seed` and the node's index."""
        self.profile = profile
        self.layout = layout
        k = profile.kind
        self.block_size = k.block_size
        self.router = Router(layout.policy)
        self.index = PrefixIndex()
        self.admission = Admission(layout.tiers, GatewayMetrics())
        self.nodes: dict[str, SimNode] = {}
        self.views: dict[str, NodeView] = {}
        self.collector = Collector()
        self._event_seq: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()
        n = 0
        token_s = profile.cpu_to_wall(profile.overheads.node_token_cpu_s)
        host = SharedHost(profile.corun) if layout.one_host and layout.num_nodes > 1 else None
        for g in layout.groups:
            for _ in range(g.count):
                nid = f"{g.role[0]}{n}"
                n += 1
                node = SimNode(
                    nid,
                    g.role,
                    profile.step,
                    num_blocks=profile.kv_blocks(),
                    block_size=k.block_size,
                    max_num_seqs=layout.max_num_seqs or k.max_num_seqs,
                    max_num_batched_tokens=layout.max_num_batched_tokens
                    or k.max_num_batched_tokens,
                    on_events=self._on_events,
                    token_s=0.0 if g.role == "prefill" else token_s,
                    decode_factor=1.0
                    if g.role == "prefill"
                    else profile.overheads.decode_step_factor,
                    host=host,
                    jitter=StepJitter(step_jitter, seed * 1000 + n) if step_jitter else None,
                )
                node.on_reserved = self._start_transfer
                self.nodes[nid] = node
                info = NodeInfo(
                    node_id=nid,
                    role=g.role,
                    url=f"sim://{nid}",
                    model=MODEL,
                    engine_id=nid,
                    block_size=k.block_size,
                    kv_layout_hash="sim",
                    kv_capacity_blocks=profile.kv_blocks(),
                    max_model_len=k.max_model_len,
                    pool=g.pool,
                    started_at=0.0,
                )
                self.views[nid] = NodeView(info=info, connected=True)
        #: D request id -> (P node, P request id): whose blocks a transfer reads
        self._sources: dict[str, tuple[SimNode, str]] = {}
        #: set by simulate(stop_early=True): the run ends once the SLO is certainly missed
        self.early: EarlyStop | None = None
        self._stopped: asyncio.Future[None] | None = None

    # -- coordinator side ----------------------------------------------------------------------
    def _on_events(self, node_id: str, events: list) -> None:
        seq = self._event_seq.get(node_id, 0) + 1
        self._event_seq[node_id] = seq
        apply_events(self.index, node_id, seq, asyncio.get_running_loop().time(), events)

    def _report_load(self, now: float) -> None:
        settle = self.layout.policy.pending_settle_s
        for nid, node in self.nodes.items():
            self.views[nid].on_load(node.load_frame(now), now, settle)
        waiting = sum(n.scheduler.num_waiting for n in self.nodes.values())
        running = sum(n.scheduler.num_running for n in self.nodes.values())
        kv = sum(n.pool.usage for n in self.nodes.values()) / len(self.nodes)
        self.collector.sample(
            now,
            self.admission.depth("interactive") + self.admission.depth("batch"),
            waiting,
            running,
            kv,
        )

    async def _load_ticker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._report_load(loop.time())
            await asyncio.sleep(LOAD_INTERVAL_S)

    def route(self, item: WorkItem, now: float):  # -> coordinator.policy.Decision
        req = RouteRequest(
            model=MODEL,
            block_hashes=block_hashes(item.prompt, self.block_size),
            num_prompt_tokens=len(item.prompt),
            max_tokens=item.max_tokens,
            tier=item.tier,
        )
        decision = self.router.route(req, self.views.values(), self.index, now)
        for node_id, (
            seqs,
            tokens,
            blocks,
        ) in decision.pending.items():  # as CoordinatorService.route
            self.views[node_id].add_pending(now, seqs, tokens, blocks)
        return decision

    # -- transfers -----------------------------------------------------------------------------
    def _start_transfer(self, d: SimNode, req: Request) -> None:
        task = asyncio.get_running_loop().create_task(self._transfer(d, req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _transfer(self, d: SimNode, req: Request) -> None:
        p, p_rid = self._sources.pop(req.request_id)
        new_blocks = len(req.block_ids) - req.num_cached_tokens // self.block_size
        nbytes = max(0, new_blocks) * self.block_size * self.profile.kind.kv_bytes_per_token
        await asyncio.sleep(self.profile.transport.seconds(nbytes))
        self.collector.transfer(nbytes)
        p.release(p_rid)
        d.kv_ready(req.request_id)

    # -- one request ---------------------------------------------------------------------------
    async def serve(self, rid: str, item: WorkItem) -> None:
        loop = asyncio.get_running_loop()
        ov = self.profile.overheads
        res = RequestResult(arrival=loop.time(), prompt_tokens=len(item.prompt), tier=item.tier)
        last = [0.0]

        def on_token(req: Request, now: float) -> None:
            now += ov.stream_s
            if res.first_token is None:
                res.first_token = now
                self._observe("ttft", res.arrival, now - res.arrival)
            else:
                self.collector.itl(now - last[0])
            last[0] = now
            res.output_tokens += 1
            res.last_token = now

        try:
            async with self.admission.slot(item.tier):
                res.admitted = loop.time()
                await asyncio.sleep(ov.request_s)
                decision = self.route(item, loop.time())
                prio = Priority.BATCH if item.tier == "batch" else Priority.INTERACTIVE
                d = self.nodes[decision.response.decode.node_id]
                params = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True)
                if decision.response.prefill is None:
                    res.path = "local"
                    req = Request(rid, item.prompt, params, priority=prio, arrival_time=loop.time())
                    await d.add(req, on_token)
                else:
                    res.path = "disaggregated"
                    p = self.nodes[decision.response.prefill.node_id]
                    p_rid = rid + "/p"
                    preq = Request(
                        p_rid,
                        item.prompt,
                        SamplingParams(max_tokens=1, ignore_eos=True),
                        priority=prio,
                        arrival_time=loop.time(),
                        hold_blocks=True,
                    )
                    await p.add(preq, lambda r, t: None)
                    await asyncio.sleep(ov.pd_hop_s)
                    self._sources[rid] = (p, p_rid)
                    req = Request(
                        rid,
                        item.prompt,
                        params,
                        priority=prio,
                        arrival_time=loop.time(),
                        remote_num_tokens=len(item.prompt),
                    )
                    await d.add(req, on_token)
                res.cached_tokens = req.num_cached_tokens
        except Shed:
            res.failure = "shed"
        except APIError as e:
            res.failure = e.code or f"http_{e.status}"
        self.collector.finish(res)
        if res.last_token is not None:
            self._observe("e2e", res.arrival, res.last_token - res.arrival)

    def _observe(self, what: str, arrival: float, latency: float) -> None:
        stop = self.early is not None and self.early.observe(what, arrival, latency)
        if stop and self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    # -- the whole run -------------------------------------------------------------------------
    async def run(self, items, *, progress=None) -> Collector:  # items: Iterable[WorkItem]
        loop = asyncio.get_running_loop()
        bg = [loop.create_task(n.run()) for n in self.nodes.values()]
        bg.append(loop.create_task(self._load_ticker()))
        requests: set[asyncio.Task] = set()
        self._stopped = loop.create_future()
        t_start = loop.time()
        for i, item in enumerate(items):
            delay = t_start + item.t - loop.time()
            if delay > 0 and self.early is None:
                await asyncio.sleep(delay)
            elif delay > 0:
                await asyncio.wait([self._stopped], timeout=delay)
            if self._stopped.done():
                break
            task = loop.create_task(self.serve(f"r{i}", item))
            requests.add(task)
            task.add_done_callback(requests.discard)
            if progress is not None:
                progress(loop.time())
        self.collector.sending_ended = loop.time()
        while requests and not self._stopped.done():
            await asyncio.wait([*requests, self._stopped], return_when=asyncio.FIRST_COMPLETED)
        if self._stopped.done():  # the SLO is missed for sure: the rest is not simulated
            self.collector.stopped = self.early.reason if self.early else "stopped"
            rest = [*requests, *self._tasks]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        self.collector.end = loop.time()
        for t in bg:
            t.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
        for n in self.nodes.values():
            self.collector.node(n.node_id, n.role, n.stats)
        return self.collector
