"""The contract between the gateway and the nodes' internal HTTP API (DESIGN §1, §4).

`NodeSpans` is a node's answer to `GET /spans?trace_id=…`: its recent spans of one trace, for
the console's request view (node/spans.py, gateway/console/node_spans.py).

The legs of a request: `NodeCompletionRequest` is what the gateway (or any client of a node)
POSTs to `/v1/completions`; a whole answer is a `NodeCompletion` (the prefill leg's carries
P's `KVTransferParams` for D), a streamed one is `NodeCompletionChunk`s as SSE, ending with
`[DONE]`. Both sides build and decode these types; neither keeps a copy of its own, and no
wire message here is a `dict[str, Any]`.

Internal requests other than the legs are refused on unknown fields (a typo must not turn into
a silent no-op).
"""

from __future__ import annotations

import msgspec

from protocol.kv_params import KVTransferParams
from protocol.openai import CompletionChoice, CompletionRequest, ErrorDetail, Usage
from protocol.resume import Resume
from protocol.retention import KVRetain
from protocol.route import KVSource
from protocol.structured import Guide
from runtime.tracing import SpanRecord


class NodeCompletionRequest(CompletionRequest, kw_only=True, omit_defaults=True):
    """A leg's request: the sampling fields, the prompt (token ids from the gateway; a node
    also tokenizes text sent by hand), `priority`, the P/D handoff, typed, the cache domain, and —
    on a migrated request's leg — where the output continues (`resume`, protocol/resume.py)."""

    # narrowed on purpose: the public body keeps vLLM's open dict, a node's leg decodes it typed
    kv_transfer_params: KVTransferParams | None = None  # type: ignore[assignment]
    #: the prefix-cache domain (vLLM's name; protocol.block_hash.domain_root): the gateway sets
    #: it from the caller's team on both legs, and a node never matches a prefix across domains
    cache_salt: str | None = None
    resume: Resume | None = None
    #: where this node pulls the prompt's prefix from before computing the rest (the route's
    #: `kv_source`, on the leg of the node that computes the prompt); None: it computes what
    #: its own cache lacks
    kv_source: KVSource | None = None
    #: the constrained-decoding guide (protocol/structured.py): P samples the first token under
    #: it (sent to D as `kv_transfer_params.first_token_id`), D resumes it from the tokens so
    #: far, P's included; None: unconstrained
    guide: Guide | None = None
    #: keep the prompt prefix's KV blocks a while (a client's `cache_control`,
    #: protocol/retention.py), on every leg that holds the prompt's KV; None: cache as usual
    retain: KVRetain | None = None
    #: the answer's logprobs carry the engine's records too (`CompletionLogprobs.records`: ids
    #: and ranks), for vLLM's token-in/token-out answer
    logprob_records: bool = False


class NodeCompletion(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A node's whole answer (`stream: false`), the prefill leg's included."""

    id: str
    object: str = "text_completion"
    created: int = 0
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: KVTransferParams | None = None
    #: duet extension: where the time went (seconds since arrival), for SREs and bench.pd
    timing: dict[str, float] | None = None


class NodeCompletionChunk(NodeCompletion, kw_only=True, omit_defaults=True):
    """One SSE event of a streamed leg. A failure after the headers went out is an event
    carrying only `error` (then `[DONE]`)."""

    id: str = ""
    model: str = ""
    choices: list[CompletionChoice] = []
    error: ErrorDetail | None = None


class KVReleaseRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Decode node → prefill node: the blocks of `request_id` were pulled (or are not wanted).
    `block_ids`, when given, must be exactly the blocks held for that request."""

    request_id: str
    block_ids: list[int] | None = None


class KVShareRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A node → a peer holding a prompt's prefix (`POST /kv/share`): hold the leading blocks of
    `block_hashes` you have, for `lease_s` seconds, so I can read them. The hashes are the
    prompt's, salted by its cache domain (`cache_salt`): the peer can only match its blocks
    of that domain, and loads spilled ones back (checked) before answering."""

    request_id: str
    block_hashes: list[int]
    cache_salt: str | None = None
    lease_s: float = 10.0


class KVShareAnswer(msgspec.Struct, kw_only=True):
    """The blocks held for a share (leading blocks of the request's hashes: maybe fewer, maybe
    none), their content digests, and the engine whose pool holds them (for the transport)."""

    engine_id: str
    block_ids: list[int]
    block_digests: list[int]


class KVShareRelease(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The reader is done with a share (`POST /kv/share/release`); `block_ids` must be its."""

    request_id: str
    block_ids: list[int] | None = None


class AbortRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str


class NodeHealth(msgspec.Struct, kw_only=True):
    status: str  # ok | draining | failed
    role: str
    node_id: str
    engine_id: str
    model: str
    detail: str | None = None


class NodeSpans(msgspec.Struct, kw_only=True):
    """A node's recent spans of one trace (`GET /spans?trace_id=<32 hex>`), in start order."""

    node_id: str
    #: False: this node keeps no span ring (tracing is off on it), so `spans` is empty
    kept: bool
    spans: list[SpanRecord] = []
    #: the trace had more spans on this node than one answer carries (MAX_TRACE_SPANS)
    truncated: bool = False


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/load_lora_adapter` (vLLM's body): load the PEFT adapter at `lora_path` (a
    directory on the node) under `lora_name`, the model name requests then use. `load_inplace`
    replaces an adapter already loaded under that name (refused while requests use it)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/unload_lora_adapter` (vLLM's body; `lora_int_id` is accepted and not used)."""

    lora_name: str
    lora_int_id: int | None = None


class SleepState(msgspec.Struct, kw_only=True):
    """`GET /is_sleeping` (vLLM's answer), and duet's figures of the last sleep and wake."""

    is_sleeping: bool
    #: seconds the last wake took to rebuild the weights (None: never woken)
    last_wake_s: float | None = None
    wakes: int = 0
