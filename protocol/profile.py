"""A node kind's profile on the wire: the schema `duet bench profile` writes (data/profiles/*.json)
and the simulator (sim/), `duet plan` and the autoscaler (planner/, the coordinator) read.

Only the schema and its JSON lives here, so a reader needs nothing but msgspec (the coordinator
may import only protocol/); fitting a step model to samples is sim/profile.py's (numpy).

A profile is one JSON file: the node kind (model, dtype/quantization, device, engine, KV
geometry, batch limits), the step-time samples, the fitted step-time model with its own fit
error, the KV transport's bandwidth and latency, the per-request and per-token overheads outside
the forward pass, and `sources`: every figure carried over from a publication, with where it
comes from. `provenance` on the step model, the transport and the overheads says whether the
numbers were *measured* on a node, *fitted* to published points, or *modelled*.

Step-time model (linear in five features of one engine step, seconds):
    t = intercept + prefill·P + decode·D + context·C + attention·A + cached_attention·B
P = prompt tokens computed in the step, D = sequences that sample a generated token, C = the
total context (tokens in the KV) of every sequence in the step, A = Σ over prefill chunks of
n·(start + n) (the quadratic part of prefill attention), B = Σ over prefill chunks of n·start
(the part of it that reads KV of earlier chunks from the paged pool, which costs more per pair
than the chunk's own: 2.7× in data/profiles' SmolLM2 bf16 samples). Coefficients are ≥ 0;
profiles fitted before B existed have cached_attention = 0 and predict as they did.

Time units: the step model and the `*_s` overheads are wall seconds at the profile's
`contention` (1.0 or None: the node had its CPUs); the `*_cpu_s` overheads are CPU seconds,
which cost `cpu × contention` of wall on a shared machine. `Profile.at_contention` moves the
wall figures to another machine state.
"""

from __future__ import annotations

import enum
from pathlib import Path

import msgspec


class Provenance(enum.StrEnum):
    MEASURED = "measured"  # timed on a real node by `duet bench profile`
    FITTED = "fitted"  # a model fitted to published points
    MODELLED = "modelled"  # a form (roofline) with assumed constants


class Source(msgspec.Struct, frozen=True, kw_only=True):
    """One figure carried over from a publication."""

    what: str
    value: str
    url: str
    note: str = ""


class StepSample(msgspec.Struct, frozen=True, array_like=True):
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    attention: int  # Σ n·(start+n) over prefill chunks
    seconds: float
    #: CPU time of the step (every thread of the process): wall / cpu shows contention
    cpu_seconds: float = 0.0
    #: Σ n·start over prefill chunks (0 in samples taken before it was recorded: the fit then
    #: reads it as attention − prefill², exact for a step with one chunk)
    cached_attention: int = 0


class StepFeatures(msgspec.Struct, frozen=True, array_like=True):
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    attention: int
    cached_attention: int = 0


class StepModel(msgspec.Struct, frozen=True, kw_only=True):
    intercept_s: float
    prefill_s: float  # per prompt token computed
    decode_s: float  # per sequence sampling a token
    context_s: float  # per context token of every sequence in the step
    attention_s: float  # per unit of Σ n·(start+n)
    provenance: Provenance
    #: per unit of Σ n·start, on top of attention_s (0 in profiles fitted before it existed)
    cached_attention_s: float = 0.0
    #: mean / max absolute percentage error of the model on its own samples (None: no samples)
    fit_mape: float | None = None
    fit_max_ape: float | None = None
    #: the same on samples held out of the fit (every 5th one)
    holdout_mape: float | None = None
    num_samples: int = 0
    #: the ranges the samples covered: beyond them the model extrapolates
    max_prefill_tokens: int = 0
    max_decode_seqs: int = 0
    max_context_tokens: int = 0

    def seconds(self, f: StepFeatures) -> float:
        return (
            self.intercept_s
            + self.prefill_s * f.prefill_tokens
            + self.decode_s * f.decode_seqs
            + self.context_s * f.context_tokens
            + self.attention_s * f.attention
            + self.cached_attention_s * f.cached_attention
        )

    def scaled(self, factor: float) -> StepModel:
        """Every coefficient × factor (a node kind that is uniformly faster or slower)."""
        return msgspec.structs.replace(
            self,
            intercept_s=self.intercept_s * factor,
            prefill_s=self.prefill_s * factor,
            decode_s=self.decode_s * factor,
            context_s=self.context_s * factor,
            attention_s=self.attention_s * factor,
            cached_attention_s=self.cached_attention_s * factor,
        )


class Transport(msgspec.Struct, frozen=True, kw_only=True):
    backend: str
    bandwidth_bytes_per_s: float
    latency_s: float
    provenance: Provenance
    #: the transfer sizes the measurement covered
    sizes_bytes: list[int] = []

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


class Overheads(msgspec.Struct, frozen=True, kw_only=True):
    """Time a request spends outside the forward pass.

    The `*_s` figures are wall seconds on the request's critical path (at the profile's
    contention); the `*_cpu_s` figures are CPU seconds a process spends (measured by `duet bench
    profile --overheads` from the processes' own CPU clocks), kept so a reader can rescale them.
    """

    #: gateway in + route + the leg's HTTP up to the node's queue (client → first step)
    request_s: float = 0.0
    #: a disaggregated request's extra hop (P's answer back to the gateway and the D leg's start)
    pd_hop_s: float = 0.0
    #: a token's way from the node's step to the client (the node's SSE write + the gateway's relay)
    stream_s: float = 0.0
    #: CPU the node's event loop spends per token it streams (detokenize, SSE frame, write): it
    #: shares the node's process (GIL) and core with the engine thread, so it lengthens the step
    #: that produced the token (the simulator adds `node_token_cpu_s × contention` per streamed
    #: token)
    node_token_cpu_s: float = 0.0
    #: CPU per request of the node's event loop (HTTP, tokenize, leg bookkeeping) beyond its tokens
    node_request_cpu_s: float = 0.0
    #: CPU per request / per relayed token of the gateway process, per request of the coordinator
    gateway_request_cpu_s: float = 0.0
    gateway_token_cpu_s: float = 0.0
    coordinator_request_cpu_s: float = 0.0
    #: a pure decode step inside a running streaming node (the engine thread's own clock,
    #: `duet:engine_decode_step_seconds`) over the step model's prediction for it at the same
    #: contention: what the node's process adds to the step itself (its event loop holding the
    #: GIL while it streams, the caches it shares). The simulator multiplies a colocated or decode
    #: node's pure decode steps by it; 1.0 in profiles measured before it existed
    decode_step_factor: float = 1.0
    provenance: Provenance = Provenance.MODELLED

    def scaled(self, factor: float) -> Overheads:
        """The wall figures × factor (CPU figures are machine-independent: they stay)."""
        return msgspec.structs.replace(
            self,
            request_s=self.request_s * factor,
            pd_hop_s=self.pd_hop_s * factor,
            stream_s=self.stream_s * factor,
        )


class CoRunShape(msgspec.Struct, frozen=True, kw_only=True):
    """One timed step shape: its CPU seconds alone and beside a busy neighbour (medians)."""

    name: str
    alone_cpu_s: float
    beside_cpu_s: float


class CoRun(msgspec.Struct, frozen=True, kw_only=True):
    """What a step costs while another node of the same kind runs steps on the same machine.

    Two single-threaded nodes on a 2-vCPU VM each have a core (no run-queue wait, so the
    contention reading does not see it), but the vCPUs may be one physical core's two
    hyperthreads, and they share the caches and the memory bus: each step's own CPU time grows.
    `duet bench profile` times the same steps alone and beside a second engine process that
    runs a busy mix (sim/corun.py); the factors are the ratios of the steps' CPU seconds (CPU,
    not wall, so a run-queue wait is never counted twice). The simulator applies them only to
    nodes that share one machine (`duet plan --one-host`, as sim.validate's clusters do): a
    step's work progresses at 1/factor while another node of the machine is mid-step.
    """

    #: a step with prompt tokens in it, and a pure decode step
    prefill_factor: float = 1.0
    decode_factor: float = 1.0
    #: the CPUs of the machine it was measured on
    cpus: int = 0
    shapes: list[CoRunShape] = []
    provenance: Provenance = Provenance.MODELLED

    def factor(self, prefill: bool) -> float:
        return self.prefill_factor if prefill else self.decode_factor


class NodeKind(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    model: str
    dtype: str
    quantization: str | None = None
    device: str  # "cpu (N threads)" or "2x H100 SXM (TP2)"
    engine: str = "native"
    gpus: int = 0
    block_size: int = 16
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class Profile(msgspec.Struct, kw_only=True):
    version: int = 1
    kind: NodeKind
    step: StepModel
    transport: Transport
    overheads: Overheads = Overheads()
    #: steps beside another busy node of the same machine (1.0: not measured)
    corun: CoRun = CoRun()
    samples: list[StepSample] = []
    sources: list[Source] = []
    notes: list[str] = []
    measured_at: str | None = None
    host: str | None = None
    #: CPU node kinds on a shared machine: the median wall × threads / CPU of the profiled steps,
    #: which the step model includes (None: the node had its CPUs, e.g. a GPU kind)
    contention: float | None = None

    def at_contention(self, factor: float) -> Profile:
        """This profile on a machine whose contention is `factor` instead of the profile's own
        (step times and per-request overheads scale with it; GPU kinds are left alone)."""
        if self.contention is None or not factor > 0:
            return self
        k = factor / self.contention
        return msgspec.structs.replace(
            self, step=self.step.scaled(k), contention=factor, overheads=self.overheads.scaled(k)
        )

    def cpu_to_wall(self, cpu_s: float) -> float:
        """Wall seconds that `cpu_s` of CPU costs at this profile's contention."""
        return cpu_s * (self.contention or 1.0)

    def kv_blocks(self) -> int:
        return self.kind.kv_capacity_tokens // self.kind.block_size


_ENC = msgspec.json.Encoder()


def save(profile: Profile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(_ENC.encode(profile), indent=1) + b"\n")


def load(path: Path | str) -> Profile:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Profile)
    except FileNotFoundError:
        raise ValueError(f"no profile at {path}") from None
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: not a duet profile ({e})") from None
