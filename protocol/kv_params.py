"""`kv_transfer_params`: the P → gateway → D handoff, with vLLM NixlConnector's field names.

The names are vLLM's on purpose (DESIGN.md §1): the same gateway can drive vLLM workers.
The prefill leg sends `{"do_remote_decode": true}`; P answers with the remote_* fields and
`do_remote_prefill: true`, which the gateway passes unchanged to D.
"""

from __future__ import annotations

import msgspec


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    #: Tokens of the prompt whose KV the remote blocks hold (all full blocks P computed).
    remote_num_tokens: int | None = None
    #: Seconds P keeps the blocks before freeing them on its own.
    lease_seconds: float | None = None
