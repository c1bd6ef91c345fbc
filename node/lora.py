"""LoRA adapters on a node, loaded and unloaded at run time with vLLM's endpoints (behind the
cluster secret, as every internal route):

- `POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace?}`: read the PEFT adapter
  directory at `lora_path` (on this node) off the event loop and the engine thread, then put it
  in a slot between two engine steps (running requests go on: a load never costs one an error);
  the least recently used adapter no request names is unloaded when the slots are full.
  200 "Success: LoRA adapter 'x' added successfully." (vLLM's text); 400 for an adapter the
  engine refuses (with the reason), a name already loaded (vLLM's words) or the base model's
  name; 503 + Retry-After when every slot's adapter is in use; 409 when `load_inplace` meets
  an adapter in use.
- `POST /v1/unload_lora_adapter {lora_name}`: 200, 404 when not loaded, 409 while requests use it.

A request runs with an adapter when its `model` names it (vLLM's convention), on either leg of a
P/D pair; `GET /v1/models` lists the adapters after the base model (`parent`: the base). The
node advertises its slots (NodeInfo.max_loras) and resident adapters (LoadFrame.lora_adapters)
so the coordinator routes an adapter's requests to nodes that hold it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from aiohttp import web

from node.engine_api import AdapterRefused, AdapterSlotsFull, EngineBusy, LoraEngine, NodeEngine
from node.state import NodeState
from protocol.node_api import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from protocol.openai import APIError

#: seconds a client is told to wait when every slot is in use
RETRY_AFTER_S = 1.0


def lora_engine(engine: NodeEngine) -> LoraEngine | None:
    """The engine as a LoRA engine, or None when it serves no adapters."""
    if isinstance(engine, LoraEngine) and engine.max_loras > 0:
        return engine
    return None


def adapter_names(engine: NodeEngine) -> list[str]:
    lora = lora_engine(engine)
    return [] if lora is None else lora.lora_names()


def _engine(state: NodeState) -> LoraEngine:
    lora = lora_engine(state.engine)
    if lora is None:
        raise APIError(
            400,
            "this node serves no LoRA adapters (start it with --max-loras N, native engine)",
            code="lora_disabled",
        )
    return lora


S = TypeVar("S")
#: a route's handler as written here, and as aiohttp takes it (node/app.py's `bind` turns one
#: into the other)
StateHandler = Callable[[NodeState, web.Request], Awaitable[web.StreamResponse]]
Route = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _decode(raw: bytes, kind: type[S]) -> S:
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise APIError(400, f"malformed request body: {e}") from None


async def handle_load(state: NodeState, request: web.Request) -> web.Response:
    body = _decode(await request.read(), LoadLoraAdapterRequest)
    lora = _engine(state)
    name = body.lora_name
    if not name or not body.lora_path:
        raise APIError(400, "both 'lora_name' and 'lora_path' must be provided", param="lora_name")
    if name == state.engine.model_name:
        raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
    if name in lora.lora_names():
        if not body.load_inplace:
            raise APIError(
                400, f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        try:
            await lora.unload_lora(name)
        except EngineBusy as e:
            raise APIError(409, str(e), code="lora_in_use") from None
    try:
        evicted = await lora.load_lora(name, body.lora_path)
    except AdapterRefused as e:
        raise APIError(400, str(e), param="lora_path", code="lora_refused") from None
    except AdapterSlotsFull as e:
        raise APIError(
            503,
            str(e),
            type_="service_unavailable",
            code="lora_slots_full",
            retry_after_s=RETRY_AFTER_S,
        ) from None
    state.metrics.lora_loaded(evicted)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def handle_unload(state: NodeState, request: web.Request) -> web.Response:
    body = _decode(await request.read(), UnloadLoraAdapterRequest)
    lora = _engine(state)
    try:
        found = await lora.unload_lora(body.lora_name)
    except EngineBusy as e:
        raise APIError(409, str(e), code="lora_in_use") from None
    if not found:
        raise APIError(
            404, f"The lora adapter '{body.lora_name}' cannot be found.", code="lora_not_found"
        )
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def add_lora_routes(app: web.Application, bind: Callable[[StateHandler], Route]) -> None:
    app.router.add_post("/v1/load_lora_adapter", bind(handle_load))
    app.router.add_post("/v1/unload_lora_adapter", bind(handle_unload))
