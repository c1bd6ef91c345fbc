"""Moving KV blocks between node processes: NIXL (default), UCX and TCP backends.

The node code needs only what is exported here:

    transport = make_transport(config.kv_backend, engine_id=node.engine_id, metrics=metrics)
    await transport.register_pool(engine.kv_pool, layout)        # once, at startup
    body = transport.metadata_bytes()                              # GET /kv/metadata
    peer = await transport.add_peer(fetched_bytes)                 # D, first contact (cached)
    await transport.read(peer, remote_block_ids, local_block_ids, timeout=5.0)
    await transport.notify(peer, b"...")                           # D → P control message
    note = await transport.next_notification()                     # P side
    await transport.close()

See kvtransfer/README.md for the backends, UCX settings and failure semantics.
"""

from kvtransfer.base import MAX_NOTIFICATION_BYTES, Peer, Transport
from kvtransfer.errors import (
    BackendUnavailable,
    BlockRangeError,
    LayoutMismatch,
    PeerError,
    TransferError,
    TransferTimeout,
)
from kvtransfer.factory import (
    BACKENDS,
    DEFAULT_BACKEND,
    available_backends,
    make_transport,
    unavailable_reason,
)
from kvtransfer.memory import allocate_pool
from kvtransfer.metadata import (
    METADATA_CONTENT_TYPE,
    Notification,
    TransportMetadata,
    decode_metadata,
    encode_metadata,
)
from kvtransfer.metrics import KVTransferMetrics

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "MAX_NOTIFICATION_BYTES",
    "METADATA_CONTENT_TYPE",
    "BackendUnavailable",
    "BlockRangeError",
    "KVTransferMetrics",
    "LayoutMismatch",
    "Notification",
    "Peer",
    "PeerError",
    "TransferError",
    "TransferTimeout",
    "Transport",
    "TransportMetadata",
    "allocate_pool",
    "available_backends",
    "decode_metadata",
    "encode_metadata",
    "make_transport",
    "unavailable_reason",
]
