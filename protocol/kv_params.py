"""`kv_transfer_params`: the P → gateway → D handoff, with vLLM NixlConnector's field names.

The names are vLLM's on purpose (DESIGN.md §1): the same gateway can drive vLLM workers.
The prefill leg sends `{"do_remote_decode": true}`; P answers with the remote_* fields and
`do_remote_prefill: true`, which the gateway passes unchanged to D.

Two fields are duet's own: `first_token_id`, the token P sampled, on a guided leg only (P
samples the first token under the guide's mask and D continues from it; an unguided request's
first token is D's to sample again from the recomputed last prompt position, the same token for
greedy), and `remote_block_digests`, the content digest of each held block
(protocol/kv_digest.py), which D checks over the bytes it read before it uses them.
"""

from __future__ import annotations

import msgspec


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    #: block ids; a vLLM prefill may answer one list of them per KV cache group
    remote_block_ids: list[int | list[int]] | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    #: Tokens of the prompt whose KV the remote blocks hold (all full blocks P computed).
    remote_num_tokens: int | None = None
    #: Seconds P keeps the blocks before freeing them on its own.
    lease_seconds: float | None = None
    #: duet's own: the first output token P sampled under the request's guide (guided legs only).
    #: D checks it against its own matcher (400 when the grammar does not allow it) and emits it
    #: as the output's first token instead of its own draw.
    first_token_id: int | None = None
    #: duet's own: the content digest of each block of `remote_block_ids`, in order, bound to
    #: its chain hash and cache domain; D recomputes them over what it read and, on a
    #: mismatch, recomputes from the first bad block. None: a prefill node that sends none
    remote_block_digests: list[int] | None = None
    # vLLM NixlConnector's own fields: a vLLM prefill answers with them and its decode leg needs
    # them back unchanged, so the typed handoff carries them (native nodes ignore them).
    tp_size: int | None = None
    dcp_size: int | None = None
    pp_size: int | None = None
    remote_blocks_expiry_time: float | None = None
    transfer_mode: str | None = None
    remote_prefill_cached_tokens: int | None = None
