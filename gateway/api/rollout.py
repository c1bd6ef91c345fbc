"""A versioned model's runtime weights and its rollout, for the admin key (the wire:
protocol/rollout.py).

- `GET /admin/models/{model}/versions`: each version's weight and its attempts in the rollout
  window on this gateway, and the rollout (phase, steps, the new version's share, its events);
- `PUT /admin/models/{model}/versions {"weights": {"v2": 10}}`: set weights now, no restart
  (a running rollout pauses: a hand's setting is never undone by it);
- `POST /admin/models/{model}/rollout {"action": "start", "to": "v2", "canary": 5}`, then
  `pause`, `resume`, `rollback`.

The weights and the rollout live in this gateway process (backends/cluster/versions.py): a
restart serves the configured weights, and with several gateways each is set on its own
(`duet rollout --gateway URL,URL` sets them all).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from gateway.backends.cluster.backend import ClusterBackend
from gateway.backends.cluster.versions import VersionSet
from gateway.state import GatewayState
from protocol.openai import APIError
from protocol.rollout import (
    Action,
    EventView,
    PolicyView,
    RolloutAction,
    RolloutView,
    SetWeights,
    VersionStatus,
    VersionsView,
)

_ENC = msgspec.json.Encoder()


def _version_set(state: GatewayState, request: web.Request) -> VersionSet:
    state.auth.require_admin(request)
    name = request.match_info["model"]
    served = state.serving.models.get(name)
    if served is None or not served.config.versions:
        raise APIError(404, f"no model {name!r} with versions here", code="model_not_found")
    backend = served.backend
    assert isinstance(backend, ClusterBackend)  # config_checks: versions are cluster models'
    return backend.versions.of(served.config)


async def _read(request: web.Request, cls: type) -> Any:
    try:
        return msgspec.json.decode(await request.read(), type=cls)
    except (msgspec.DecodeError, RecursionError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request: {e}") from None


def view(vs: VersionSet) -> VersionsView:
    r, p = vs.rollout, vs.rollout.policy
    r.tick(force=True)
    rows = []
    for v in vs.versions:
        s = vs.outcomes.stats(v.name, p.window_s)
        attempted, failed = vs.outcomes.totals.get(v.name, (0, 0))
        rows.append(
            VersionStatus(
                name=v.name,
                served_name=v.served_name,
                weight=vs.weights[v.name],
                attempts=s.attempts,
                failed=s.failed,
                ttft_p90_s=s.ttft_p90_s,
                itl_p90_s=s.itl_p90_s,
                total_attempts=attempted,
                total_failed=failed,
            )
        )
    total = sum(vs.weights.values())
    rollout = RolloutView(
        phase=r.phase.value,
        old=r.old,
        new=r.new,
        steps=list(r.steps),
        share=100.0 * vs.weights[r.new] / total if r.new else 0.0,
        reason=r.reason,
        policy=PolicyView(
            steps=list(p.steps),
            step_interval_s=p.step_interval_s,
            window_s=p.window_s,
            max_error_rate=p.max_error_rate,
            max_ttft_p90_ratio=p.max_ttft_p90_ratio,
            max_itl_p90_ratio=p.max_itl_p90_ratio,
            min_requests=p.min_requests,
        ),
        events=[EventView(at=e.at, what=e.what, weights=e.weights) for e in r.events],
    )
    return VersionsView(model=vs.config.name, versions=rows, rollout=rollout)


def _answer(vs: VersionSet) -> web.Response:
    return web.Response(body=_ENC.encode(view(vs)), content_type="application/json")


async def get_versions(state: GatewayState, request: web.Request) -> web.Response:
    return _answer(_version_set(state, request))


async def set_weights(state: GatewayState, request: web.Request) -> web.Response:
    vs = _version_set(state, request)
    body: SetWeights = await _read(request, SetWeights)
    try:
        vs.set_weights(body.weights)
    except (KeyError, ValueError) as e:
        raise APIError(400, str(e.args[0]), param="weights") from None
    return _answer(vs)


async def rollout(state: GatewayState, request: web.Request) -> web.Response:
    vs = _version_set(state, request)
    body: RolloutAction = await _read(request, RolloutAction)
    r = vs.rollout
    if body.action == Action.START:
        if body.to is None:
            raise APIError(400, "start needs `to`: the version to roll out", param="to")
        if body.canary is not None and not 0 < body.canary <= 100:
            raise APIError(400, "canary is a share in (0, 100] percent", param="canary")
        try:
            vs.start_rollout(body.to, body.canary)
        except (KeyError, ValueError) as e:
            raise APIError(400, str(e.args[0]), param="to") from None
    elif body.action == Action.PAUSE:
        r.pause()
    elif body.action == Action.RESUME:
        r.resume()
    elif not r.new:
        raise APIError(409, "no rollout was started: nothing to roll back", code="conflict")
    else:
        r.rollback("asked by an operator")
    return _answer(vs)
