"""The routing policy: pick the decode node D and, unless D should prefill locally, the
prefill node P for one request (DESIGN §1 step 2). Pure: no I/O, so it is tested exactly.

Costs are in "token-equivalents" with named weights (`RouteWeights`, with the thresholds and
the decision's types in coordinator/route_config.py), after Dynamo's KV
router: the prefill work a node would do is its uncached prompt tokens plus the prefill
tokens already queued on it; a decode node's load is its sequences (running + waiting +
pending) and its KV use.

- D candidates: role decode|both, active, serving the model, reporting load, with free KV
  blocks for the prompt plus `max_tokens` (admission). Plan for each D:
  * local prefill (`prefill: null`) when its uncached tokens are under `local_prefill_tokens`,
    when no compatible P exists, when D itself is the cheapest prefill node, or when the best
    P is saturated (`prefill_saturation_tokens` queued) while D is not;
  * otherwise disaggregated with the cheapest compatible P (same model and KV layout hash).
  The D whose plan costs least wins; ties go to the lower node id (stable, testable).
- Tasks: a request goes only to nodes of its task (NodeInfo.task): an embedding request to the
  embed node with the fewest queued prompt tokens (no P/D plan, `prefill: null`), a generation
  request never to an embed node.
- Tiers: a request uses its tier's pool ("interactive" | "batch") when that pool has a usable
  node of the role, else the "shared" pool; D and P fall back independently.
- KV reuse (coordinator/kv_reuse.py): a node's prefill work is its uncached tokens plus what
  getting the cached ones costs — nothing from its pool, a load from its host or disk tier, or a
  pull from the node holding the longest prefix (`kv_source` in the answer, for the node that
  computes the prompt) when that is cheaper than computing. Each decision says how much reuse
  existed on any node of the model and how much the route captured, by where (`RouteReuse`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from coordinator.eligible import usable_nodes, validate
from coordinator.index import PrefixIndex
from coordinator.kv_reuse import Reuse, RouteReuse, best_source, reuse_for
from coordinator.nodes import NodeView, PendingTotals
from coordinator.route_config import Decision, PolicyConfig, RouteOutcome
from protocol.cluster import NodeTask, kv_layouts_match
from protocol.openai import APIError
from protocol.route import KVSource, RouteRequest, RouteResponse, RouteTarget


@dataclass(slots=True)
class _Facts:
    """One request's facts every step of the policy reads."""

    req: RouteRequest
    n_prompt: int
    #: prompt + max_tokens: the KV a decode node must have room for
    need_len: int
    #: node id → prompt blocks its prefix cache holds (the index's match)
    matches: dict[str, int]
    pend: dict[str, PendingTotals]
    #: node id → prompt tokens it holds (any tier)
    cached: dict[str, int]
    #: node id → what it costs beyond its load to run this request there: loading the request's
    #: LoRA adapter, waking from sleep
    extra: dict[str, float]
    #: node id → its cheapest way to the prefix (its own KV, or pulled from a source)
    reuse: dict[str, Reuse]
    #: the most prompt tokens any node serving the model holds
    existed: int


class _Plan(NamedTuple):
    """One decode node's best plan: its total cost, the P (None: prefill on D), and why. (A
    tuple: one is made per decode candidate per decision, and a frozen dataclass costs more.)"""

    total: float
    d: NodeView
    p: NodeView | None
    outcome: RouteOutcome
    why: tuple[object, ...]


POOL_FALLBACK = "shared"
_WHY = {
    RouteOutcome.LOCAL_SHORT: "{} uncached prompt tokens on D < local_prefill_tokens {threshold}",
    RouteOutcome.LOCAL_CACHED: "{} uncached prompt tokens on D < local_prefill_tokens {threshold}",
    RouteOutcome.LOCAL_NO_PREFILL: "no compatible prefill node is usable",
    RouteOutcome.LOCAL_PREFILL_IS_D: "D is also the cheapest prefill node",
    RouteOutcome.LOCAL_P_SATURATED: "prefill pool saturated ({} has {} tokens queued)",
    RouteOutcome.DISAGGREGATED: "P {} prefill cost {:.0f} ({} uncached)",
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pools(tier: str) -> list[str]:
    return [tier, POOL_FALLBACK] if tier != POOL_FALLBACK else [POOL_FALLBACK]


def _by_pool(nodes: Iterable[NodeView], pools: list[str]) -> list[NodeView]:
    """The nodes of the first pool in `pools` that has any."""
    nodes = list(nodes)
    for pool in pools:
        found = [n for n in nodes if n.info.pool == pool]
        if found:
            return found
    return []


class Router:
    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    def _prefill_cost(self, n: NodeView, uncached: int, pend: PendingTotals) -> float:
        w = self.config.weights
        assert n.load is not None
        return w.prefill_token * uncached + w.queued_prefill_token * (
            n.load.queued_prefill_tokens + pend.prefill_tokens
        )

    def _decode_cost(self, n: NodeView, pend: PendingTotals) -> float:
        w, load = self.config.weights, n.load
        assert load is not None
        total = max(load.kv_blocks_total, 1)
        usage = min(1.0, (total - load.kv_blocks_free + pend.blocks) / total)
        seqs = load.num_requests_running + load.num_requests_waiting + pend.seqs
        return w.decode_seq * seqs + w.kv_usage * usage

    def route(
        self, req: RouteRequest, nodes: Iterable[NodeView], index: PrefixIndex, now: float
    ) -> Decision:
        validate(req)
        usable, serving = usable_nodes(req, nodes, now, self.config.stale_load_s)
        pools = _pools(req.tier)
        if req.task == NodeTask.EMBED:
            return self._embed(req, usable, pools, now)
        r = self._facts(req, usable, serving, index, now)
        ds = self._admitted(r, usable, pools)
        ps_all = _by_pool([n for n in usable if n.info.role in ("prefill", "both")], pools)
        # Prefill costs do not depend on D: compute them once, cheapest first.
        p_ranked = sorted((self._work(r, n) + r.extra[n.node_id], n.node_id, n) for n in ps_all)
        p_cost_of = {node_id: cost for cost, node_id, _ in p_ranked}
        best: _Plan | None = None
        for d in ds:
            plan = self._plan(r, d, p_ranked, p_cost_of)
            if best is None or (plan.total, d.node_id) < (best.total, best.d.node_id):
                best = plan
        assert best is not None
        return self._decision(r, best, len(ds))

    def _work(self, r: _Facts, n: NodeView) -> float:
        """Prefill work on `n`: its uncached tokens, getting its reused KV, its queue."""
        reuse = r.reuse[n.node_id]
        uncached = r.n_prompt - reuse.tokens
        return self._prefill_cost(n, uncached, r.pend[n.node_id]) + reuse.cost

    def _embed(
        self, req: RouteRequest, usable: list[NodeView], pools: list[str], now: float
    ) -> Decision:
        """An embedding request: the embed node of the first pool with any whose queued prompt
        tokens (its load's plus pending decisions') are fewest; ties to the lower node id."""
        n_prompt = req.num_prompt_tokens
        ranked = sorted(
            (
                self._prefill_cost(
                    n, n_prompt, n.pending_totals(now, self.config.pending_max_age_s)
                ),
                n.node_id,
                n,
            )
            for n in _by_pool(usable, pools)
        )
        cost, node_id, n = ranked[0]
        target = RouteTarget(node_id=node_id, url=n.info.url)
        reason = (
            f"{RouteOutcome.EMBED}: {node_id} (pool {n.info.pool}) cost {cost:.0f} among "
            f"{len(ranked)} embed node(s)"
        )
        return Decision(
            response=RouteResponse(prefill=None, decode=target, reason=reason),
            outcome=RouteOutcome.EMBED,
            pending={node_id: (0, n_prompt, 0)},
        )

    def _facts(
        self,
        req: RouteRequest,
        usable: list[NodeView],
        serving: list[str],
        index: PrefixIndex,
        now: float,
    ) -> _Facts:
        everywhere = index.match(req.block_hashes, serving)
        ids = {n.node_id for n in usable}
        matches = {k: v for k, v in everywhere.items() if k in ids}
        n_prompt = req.num_prompt_tokens
        bs = min((n.info.block_size for n in usable), default=1)
        source = best_source(usable, matches, index, req.block_hashes)
        cfg = self.config
        return _Facts(
            req=req,
            n_prompt=n_prompt,
            need_len=n_prompt + req.max_tokens,
            matches=matches,
            pend={n.node_id: n.pending_totals(now, cfg.pending_max_age_s) for n in usable},
            # The last prompt token is always computed (DESIGN §3), so at most n_prompt - 1 cached.
            cached={
                n.node_id: min(matches.get(n.node_id, 0) * n.info.block_size, n_prompt - 1)
                for n in usable
            },
            extra={n.node_id: self._extra(n, req.lora_name) for n in usable},
            reuse={
                n.node_id: reuse_for(
                    n,
                    source,
                    matches,
                    index,
                    req.block_hashes,
                    n_prompt,
                    cfg.kv,
                    cfg.weights.prefill_token,
                )
                for n in usable
            },
            existed=min(max(everywhere.values(), default=0) * bs, n_prompt - 1),
        )

    def _extra(self, n: NodeView, lora: str | None) -> float:
        w, load = self.config.weights, n.load
        assert load is not None
        return (w.lora_load if lora and not n.holds_adapter(lora) else 0.0) + (
            w.wake if load.sleeping else 0.0
        )

    def _admitted(self, r: _Facts, usable: list[NodeView], pools: list[str]) -> list[NodeView]:
        """D admission: decode-capable nodes with free KV blocks for the prompt and max_tokens,
        of the first pool that has any; 503 no_capacity (saying why) when none."""
        admitted: list[NodeView] = []
        refused: list[str] = []
        for d in usable:
            if d.info.role not in ("decode", "both"):
                continue
            assert d.load is not None
            need = _cdiv(r.need_len, d.info.block_size) - r.matches.get(d.node_id, 0)
            free = d.load.kv_blocks_free - r.pend[d.node_id].blocks
            if free >= need:
                admitted.append(d)
            else:
                refused.append(f"{d.node_id} ({free} free blocks < {need})")
        ds = _by_pool(admitted, pools)
        if not ds:
            why = "; ".join(refused) if refused else "no decode-capable node is usable"
            raise APIError(
                503,
                f"no decode node for {r.req.model!r} in pools {pools} has room: {why}",
                type_="service_unavailable",
                code="no_capacity",
                retry_after_s=1,
            )
        return ds

    def _plan(
        self,
        r: _Facts,
        d: NodeView,
        p_ranked: list[tuple[float, str, NodeView]],
        p_cost_of: dict[str, float],
    ) -> _Plan:
        """The cheapest plan with `d` as the decode node: local prefill, or the cheapest P of
        D's KV layout. The reason text is built for the winner only: `why` holds its template's
        arguments."""
        cfg, pd, n_prompt = self.config, r.pend[d.node_id], r.n_prompt
        d_cost = self._decode_cost(d, pd) + r.extra[d.node_id]
        # the threshold reads what D holds itself: a prompt D cannot mostly serve from its own
        # KV goes to a P (which may pull it), so D's pull is a cost, not a reason to stay local
        uncached_d = n_prompt - r.cached[d.node_id]
        local_cost = self._work(r, d)
        if uncached_d < cfg.local_prefill_tokens:
            short = n_prompt < cfg.local_prefill_tokens
            outcome = RouteOutcome.LOCAL_SHORT if short else RouteOutcome.LOCAL_CACHED
            return _Plan(d_cost + local_cost, d, None, outcome, (uncached_d,))
        layout = d.info.kv_layout_hash
        found = next(
            (t for t in p_ranked if kv_layouts_match(t[2].info.kv_layout_hash, layout)), None
        )
        if found is None:
            return _Plan(d_cost + local_cost, d, None, RouteOutcome.LOCAL_NO_PREFILL, ())
        p_cost, _, p_best = found
        if p_cost_of.get(d.node_id) == p_cost:  # on a tie D itself wins: no KV moves
            p_best = d
        p_queued = p_best.load.queued_prefill_tokens + r.pend[p_best.node_id].prefill_tokens  # type: ignore[union-attr]
        d_queued = d.load.queued_prefill_tokens + pd.prefill_tokens  # type: ignore[union-attr]
        if p_best is d:
            return _Plan(d_cost + local_cost, d, None, RouteOutcome.LOCAL_PREFILL_IS_D, ())
        if p_queued >= cfg.prefill_saturation_tokens and d_queued < cfg.prefill_saturation_tokens:
            return _Plan(
                d_cost + local_cost,
                d,
                None,
                RouteOutcome.LOCAL_P_SATURATED,
                (p_best.node_id, p_queued),
            )
        why = (p_best.node_id, p_cost, n_prompt - r.reuse[p_best.node_id].tokens)
        return _Plan(d_cost + p_cost, d, p_best, RouteOutcome.DISAGGREGATED, why)

    def _decision(self, r: _Facts, best: _Plan, n_candidates: int) -> Decision:
        d, p, outcome, cached, n_prompt = best.d, best.p, best.outcome, r.cached, r.n_prompt
        d_blocks = _cdiv(r.need_len, d.info.block_size) - r.matches.get(d.node_id, 0)
        pending: dict[str, tuple[int, int, int]] = {}
        if p is None:
            pending[d.node_id] = (1, n_prompt - r.reuse[d.node_id].tokens, d_blocks)
        else:
            pending[d.node_id] = (1, 0, d_blocks)
            pending[p.node_id] = (
                0,
                n_prompt - r.reuse[p.node_id].tokens,
                _cdiv(n_prompt, p.info.block_size),
            )
        load = d.load
        assert load is not None
        why = _WHY[outcome].format(*best.why, threshold=self.config.local_prefill_tokens)
        reason = (
            f"{outcome}: {why}; D {d.node_id} (pool {d.info.pool}, running "
            f"{load.num_requests_running}, waiting {load.num_requests_waiting}, kv "
            f"{load.kv_cache_usage_perc:.2f}, {cached[d.node_id]} cached) total cost "
            f"{best.total:.0f} among {n_candidates} decode candidate(s)"
        )
        computing = r.reuse[(p or d).node_id]
        src = computing.source
        if src is not None:
            reason += f"; KV of {computing.pulled} tokens pulled from {src.node_id}"
        resp = RouteResponse(
            prefill=None
            if p is None
            else RouteTarget(node_id=p.node_id, url=p.info.url, cached_tokens=cached[p.node_id]),
            decode=RouteTarget(node_id=d.node_id, url=d.info.url, cached_tokens=cached[d.node_id]),
            reason=reason,
            kv_source=None
            if src is None
            else KVSource(
                node_id=src.node_id,
                url=src.info.url,
                num_blocks=computing.source_blocks,
                from_block=computing.own_blocks,
            ),
        )
        lora = r.req.lora_name
        loads = [] if not lora else [n.node_id for n in (d, p) if n and not n.holds_adapter(lora)]
        captured = {**computing.own, "peer": computing.pulled}
        reuse = RouteReuse(prompt_tokens=n_prompt, existed=r.existed, captured=captured)
        return Decision(
            response=resp, outcome=outcome, pending=pending, lora_loads=loads, reuse=reuse
        )
