"""The node → coordinator KV event stream (DESIGN §4): `GET /kv/events?since=SEQ`.

Wire format: a stream of frames, each a 4-byte big-endian length followed by that many bytes
of msgpack encoding one `Frame` (a tagged union; the tag is the struct name). Content type
`application/vnd.duet.kv-events+msgpack`.

- `EventBatch{seq, events}`: KV cache changes in vLLM's schema (`BlockStored`,
  `BlockRemoved`, `AllBlocksCleared`, same field names). `seq` counts batches per node engine
  from 1, +1 per batch with no gaps; a reader that sees `seq != last + 1` has missed changes
  and must resync from `GET /kv/snapshot`.
- Tiers (vLLM's `medium` field): a node's block lives in exactly one of its KV pool (`medium`
  None), its host spill tier ("host") or its disk tier ("disk"). `BlockStored` says where the
  blocks are now — a stored event for a block the node already holds moves it there;
  `BlockRemoved` means the node holds the blocks nowhere any more (its `medium` names the tier
  they left). An older reader ignores the field and counts spilled blocks as cached (an
  over-estimate: a hit there costs a load, not a recompute); an older node never sets it.
- `LoadFrame`: the node's load, sent at least every `LOAD_INTERVAL_S`; `seq` is the last batch
  sent before it (a reader that holds an older seq is behind). `taken` acknowledges routes: the
  X-Request-Ids of the requests the node's engine took since this stream's previous load frame
  (their work is in this frame's counters, or was already done), so a coordinator drops its
  pending reservation for a route exactly when the node's load shows it. None: the node does
  not acknowledge (the simulator, older nodes); the reader falls back to a settle time.
  Measured latency over the node's last `latency_window_s` (node/latency_window.py): the P90 of
  its TTFT (prefill and colocated nodes: arrival to first token, queue + prefill) and of its
  inter-token gaps (decode and colocated nodes), each with its sample count; the planner's load
  mode weighs them against its prediction. Every one defaults to 0: an older node (or the
  simulator) sends none, and 0 samples means "not measured". With each P90 goes the window's
  distribution, `ttft_hist` / `itl_hist` (protocol/latency_hist.py: counts over fixed
  log-spaced buckets), which the planner merges over a pool's nodes for the pool's P90 (a mean
  of the nodes' P90s is not a pool quantile). They default to None: an older node sends none
  (the planner then weighs that node's own P90 by its samples), and an older reader ignores
  them (msgspec skips fields a Struct does not know), so the change interoperates both ways.

The stream starts after `since` (the reader has applied batches `≤ since`). A `since` older
than the node's ring of recent batches, or newer than its last batch, answers 410 with an
OpenAI-shaped error: resync from the snapshot. `GET /kv/snapshot` answers `KVSnapshot`
(JSON): every cached block hash as of batch `seq`, so the reader continues with `since=seq`.
"""

from __future__ import annotations

import msgspec

from protocol.latency_hist import LatencyHistogram

CONTENT_TYPE = "application/vnd.duet.kv-events+msgpack"
#: a load frame goes out at least this often (seconds)
LOAD_INTERVAL_S = 0.2
#: frames larger than this are refused by readers (a corrupt length prefix)
MAX_FRAME_BYTES = 64 * 2**20


#: spill tiers, by `medium` (None: the KV pool itself)
MEDIA = ("host", "disk")


class BlockStored(msgspec.Struct, frozen=True, kw_only=True, tag=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    #: where the blocks now are: None for the KV pool, else "host" or "disk"
    medium: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, kw_only=True, tag=True, omit_defaults=True):
    block_hashes: list[int]
    #: the tier the blocks left (None: the KV pool); the node holds them nowhere now
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    seq: int
    #: node wall-clock time the batch was drained from the engine (for event-lag metrics)
    ts: float
    events: list[KVEvent]


class KVReuse(msgspec.Struct, frozen=True, kw_only=True):
    """A node's engine counters of reused KV since it started: the prompt tokens of the requests
    whose prompt it computed, and the tokens of those it did not compute, by where their KV was
    (its pool, its host or disk tier, a peer it pulled from)."""

    prompt_tokens: int = 0
    pool: int = 0
    host: int = 0
    disk: int = 0
    peer: int = 0


class LoadFrame(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    seq: int
    ts: float
    num_requests_waiting: int
    num_requests_running: int
    kv_cache_usage_perc: float
    #: prompt tokens admitted but not yet computed (waiting + partially prefilled)
    queued_prefill_tokens: int
    kv_blocks_free: int
    kv_blocks_total: int
    #: X-Request-Ids the engine took since the previous load frame on this stream (see above)
    taken: list[str] | None = None
    #: measured TTFT P90 (seconds) over the last `latency_window_s`, from `ttft_samples` requests
    ttft_p90_s: float = 0.0
    ttft_samples: int = 0
    #: measured inter-token latency P90 (seconds) over the same window, from `itl_samples` gaps
    itl_p90_s: float = 0.0
    itl_samples: int = 0
    latency_window_s: float = 0.0
    #: the same windows' distributions (None: an older node; the planner falls back to the P90s)
    ttft_hist: LatencyHistogram | None = None
    itl_hist: LatencyHistogram | None = None
    #: share of the node's recent wall time (about `latency_window_s`) its engine spent in
    #: forward passes, 0..1 (node/busy_window.py); None: not known yet, or an engine that does
    #: not count it (vLLM), or an older node
    busy: float | None = None
    #: the LoRA adapters resident on the node (None: it serves none, or an older node); the
    #: coordinator routes an adapter's requests to nodes that hold it
    lora_adapters: list[str] | None = None
    #: the engine sleeps (weights and KV pool released: its next request waits for a wake);
    #: None: an engine without sleep mode, or an older node
    sleeping: bool | None = None
    #: the engine's reuse counters (None: an engine that keeps none, or an older node)
    reuse: KVReuse | None = None


Frame = EventBatch | LoadFrame


class KVSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    engine_id: str
    block_size: int
    #: the last event batch this snapshot includes
    seq: int
    #: the blocks in the KV pool
    block_hashes: list[int]
    #: the blocks in the spill tiers (none on an older node, or without tiers)
    host_block_hashes: list[int] = []
    disk_block_hashes: list[int] = []


class FrameDecoder:
    """Splits a byte stream into frames (feed chunks, get whole frames back)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._decoder = msgspec.msgpack.Decoder(Frame)

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        out: list[Frame] = []
        while len(self._buf) >= 4:
            n = int.from_bytes(self._buf[:4], "big")
            if n > MAX_FRAME_BYTES:
                raise ValueError(f"KV event frame of {n} bytes (corrupt stream?)")
            if len(self._buf) < 4 + n:
                break
            out.append(self._decoder.decode(bytes(self._buf[4 : 4 + n])))
            del self._buf[: 4 + n]
        return out


def encode_frame(encoder: msgspec.msgpack.Encoder, frame: Frame) -> bytes:
    body = encoder.encode(frame)
    return len(body).to_bytes(4, "big") + body
