"""VllmEngineConfig: what a node running vLLM (`--engine vllm`) asks of it, and its translation
into vLLM's engine arguments and environment.

Pure data: importing this module never imports vLLM, so `duet node --help`, config errors and
unit tests work on machines without it.

Mapping of duet's node options onto vLLM:
- P/D: vLLM's own NixlConnector with `kv_role=kv_both` (CPU buffers on CPU machines, device
  memory on GPUs); its handshake listens on `nixl_port` (default: the HTTP port + 1), advertised
  as `nixl_host`.
- `--failure-policy` → `kv_transfer_config.kv_load_failure_policy` (same names).
- `--lease-s` → the connector's `kv_lease_duration` (and `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`,
  the name older vLLM releases read), so P frees unpulled blocks when the lease ends.
- `--vllm-nixl-progress-thread` → NIXL's progress thread in vLLM's agents, through duet's vLLM
  plugin (node/engines/vllm_plugin.py). vLLM's default thread spins a core per node. By default
  on CPUs: off on decode nodes (a decode node only reads; its step progresses them), and on
  prefill and colocated nodes a thread that sleeps in poll() between UCX events (`poll`): with no
  thread, a prefill node whose engine went idle hung three concurrent guided prefill legs for
  120 s (the vLLM stage, 2026-12-03). GPUs keep vLLM's default.
- `record_kv_events` → `kv_events_config` with a ZMQ publisher on a private ipc:// endpoint,
  read back by node.engines.vllm_events.
- `--block-size` stays duet's hash block (the gateway's and coordinator's unit); vLLM's own block
  is the smallest multiple of it vLLM accepts (32 on CPUs), see `vllm_block_size`.
- `--kv-memory` → `VLLM_CPU_KVCACHE_SPACE` (whole GiB, at least 1) on CPU,
  `kv_cache_memory_bytes` on GPUs.
- structured outputs: `structured_outputs_config` defaults to vLLM's `guidance` backend
  (llguidance, the grammar engine the gateway checks guides with and the native engine masks
  with, so a guide the gateway accepts means the same language on either engine) with
  `disable_any_whitespace` (compact JSON, like the native engine: a small model cannot pad its
  output with whitespace until max_tokens). vLLM reads whitespace only from this engine-wide
  config, never from a request's StructuredOutputsParams. A `--vllm-arg` may replace it.
- anything else: `--vllm-arg KEY=VALUE` (an AsyncEngineArgs field; VALUE is read as JSON when it
  parses, else as a string). duet's own options win over a `--vllm-arg` that names the same
  field only when the operator did not give that field: an explicit `--vllm-arg` is applied last.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

GIB = 1 << 30
#: vLLM's CPU attention backend takes blocks of a multiple of this many tokens
CPU_BLOCK_MULTIPLE = 32
#: kv_transfer_config.kv_role for every role: a node may serve either leg (a colocated node both)
KV_ROLE = "kv_both"
#: vLLM options duet sets itself; a --vllm-arg for them would silently break the node contract
#: vLLM's structured-outputs config for duet's guides (see the module docstring)
STRUCTURED_OUTPUTS = {"backend": "guidance", "disable_any_whitespace": True}
RESERVED_ARGS = frozenset({"model", "kv_transfer_config", "kv_events_config", "tokenizer"})


def parse_vllm_args(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """['enforce_eager=true', 'max_num_seqs=8'] → {'enforce_eager': True, 'max_num_seqs': 8}.

    Dashes in keys become underscores (vLLM's CLI spelling works too)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--vllm-arg {item!r}: expected KEY=VALUE, e.g. enforce_eager=true")
        if not key.isidentifier():
            raise ValueError(f"--vllm-arg {item!r}: {key!r} is not an engine argument name")
        if key in RESERVED_ARGS:
            raise ValueError(
                f"--vllm-arg {key}: duet sets this itself (use --model, --failure-policy, "
                "--lease-s, --etcd)"
            )
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        out[key] = value
    return out


def kv_memory_bytes(spec: str | int) -> int:
    """'512MiB', '1GiB', '2GB', 1073741824 → bytes."""
    if isinstance(spec, int):
        return spec
    text = spec.strip()
    units = {
        "KIB": 1 << 10,
        "MIB": 1 << 20,
        "GIB": GIB,
        "TIB": 1 << 40,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "B": 1,
    }
    unit = next((u for u in units if text.upper().endswith(u)), None)
    number, mult = (text[: -len(unit)].strip(), units[unit]) if unit else (text, 1)
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot read KV memory size {spec!r} (try 1GiB or 512MiB)") from None
    if value <= 0:
        raise ValueError(f"KV memory must be positive, got {spec!r}")
    return int(value * mult)


#: the longest a polling NIXL progress thread sleeps when no UCX event wakes it (NIXL rounds up
#: to whole ms): its own workaround for event fds that fail to wake, so it bounds a stuck read
NIXL_POLL_US = 1000


def vllm_kv_cache_dtype(name: str) -> str:
    """duet's --kv-cache-dtype as vLLM's `kv_cache_dtype`: auto and fp8 pass through; int8 is
    the native engine's format, which vLLM does not have (its 8-bit KV is fp8)."""
    if name in ("auto", "fp8"):
        return name
    if name == "int8":
        raise ValueError(
            "--kv-cache-dtype int8 is the native engine's 8-bit KV; vLLM has no int8 KV cache: "
            "use --kv-cache-dtype fp8 with --engine vllm"
        )
    raise ValueError(f"unknown --kv-cache-dtype {name!r} for --engine vllm (auto or fp8)")


@dataclass(frozen=True)
class VllmOptions:
    """What a node of `--engine vllm` sets beyond the node's and the engine's settings (its flags
    are generated from these fields, duet/config_flags.py)."""

    #: --engine vllm: one more vLLM engine argument (an AsyncEngineArgs field; VALUE is JSON when
    #: it parses, else a string), e.g. enforce_eager=true or compilation_config='{"mode": 0}'.
    #: Repeat as needed
    vllm_args: tuple[str, ...] = field(
        default=(), metadata={"flag": "vllm-arg", "metavar": "KEY=VALUE"}
    )
    #: --engine vllm: port of vLLM's NIXL handshake listener (default: --port + 1)
    nixl_port: int | None = None
    #: --engine vllm: NIXL's progress thread in vLLM's KV connector. on: vLLM's default, which
    #: spins a whole core per node; poll: the thread sleeps in poll() between UCX events (wakes at
    #: least every 1 ms); off: none. auto: off on CPU decode nodes (they only read, and their
    #: steps progress the reads), poll on CPU prefill and colocated nodes (their held blocks are
    #: read while their engine may idle), on on GPUs
    vllm_nixl_progress_thread: Literal["auto", "on", "poll", "off"] = "auto"


@dataclass
class VllmEngineConfig:
    model: str
    role: str = "both"
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    kv_memory: str | int = "1GiB"
    #: duet's --kv-cache-dtype; vLLM gets its own name for it (`vllm_kv_cache_dtype`)
    kv_cache_dtype: str = "auto"
    #: CPU threads for vLLM's CPU backend (VLLM_CPU_OMP_THREADS_BIND=nobind + torch threads)
    threads: int | None = None
    #: prefill side: seconds an unpulled prefill's blocks are kept (kv_lease_duration)
    lease_s: float = 30.0
    #: decode side: kv_load_failure_policy
    failure_policy: str = "recompute"
    #: NIXL handshake (side channel) address this node advertises and its port
    nixl_host: str = "127.0.0.1"
    nixl_port: int = 5600
    #: NIXL's progress thread in vLLM's agents, "on" (vLLM's: it spins), "poll" (sleeps in poll()
    #: between UCX events, waking at least every NIXL_POLL_US) or "off"; None: off on CPU decode
    #: nodes (they only read, and their steps progress their reads), poll on other CPU nodes, on
    #: on GPUs. node/engines/vllm_plugin.py applies it
    nixl_progress_thread: str | None = None
    #: publish KV events for the coordinator (GET /kv/events)
    record_kv_events: bool = False
    #: ZMQ endpoint of vLLM's KV event publisher (set by the adapter when recording)
    kv_events_endpoint: str | None = None
    #: seconds vLLM may take to start (load, compile, profile) before the node gives up
    startup_timeout: float = 900.0
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"failure policy must be recompute or fail, got {self.failure_policy!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"block size must be positive, got {self.block_size}")
        if not 0 < self.nixl_port < 65536:
            raise ValueError(f"NIXL side-channel port {self.nixl_port} is not a TCP port")
        kv_memory_bytes(self.kv_memory)
        vllm_kv_cache_dtype(self.kv_cache_dtype)

    def on_cpu(self) -> bool:
        if self.device.startswith("cuda"):
            return False
        if self.device == "cpu":
            return True
        import torch

        return not torch.cuda.is_available()

    def vllm_block_size(self) -> int:
        """vLLM's own block: `block_size` (duet's hash block) unless vLLM needs larger ones —
        its CPU attention takes multiples of 32 — or the operator set it (--vllm-arg
        block_size=N, a multiple of block_size). KV events are translated back to duet's blocks."""
        vbs = self.extra_args.get("block_size")
        if vbs is None:
            vbs = self.block_size
            while self.on_cpu() and vbs % CPU_BLOCK_MULTIPLE:
                vbs += self.block_size
        if not isinstance(vbs, int) or vbs < 1 or vbs % self.block_size:
            raise ValueError(
                f"--vllm-arg block_size={vbs!r} must be a multiple of "
                f"--block-size {self.block_size}"
            )
        return vbs

    def environment(self) -> dict[str, str]:
        """Environment variables vLLM (and its engine-core process) reads at start-up."""
        lease = str(max(1, math.ceil(self.lease_s)))
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.nixl_host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port),
            "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": lease,
            # Nothing is ever loaded from a model hub at run time (DESIGN §3).
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        thread = self.nixl_progress_thread
        if (
            thread is None
        ):  # a prefill node's blocks are read while its engine may be idle: a thread there
            thread = "on" if not self.on_cpu() else "off" if self.role == "decode" else "poll"
        env["DUET_VLLM_NIXL_PROGRESS_THREAD"] = {
            "on": "1",
            "off": "0",
            "poll": f"poll:{NIXL_POLL_US}",
        }[thread]
        if self.on_cpu():
            env["VLLM_CPU_KVCACHE_SPACE"] = str(
                max(1, math.ceil(kv_memory_bytes(self.kv_memory) / GIB))
            )
            if self.threads:
                # vLLM binds one OpenMP thread per core by default; a shared machine wants fewer.
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
                env["OMP_NUM_THREADS"] = str(self.threads)
        return env

    def engine_kwargs(self, model_dir: str) -> dict[str, Any]:
        """AsyncEngineArgs keyword arguments."""
        kw: dict[str, Any] = {
            "model": model_dir,
            "served_model_name": None,
            "dtype": self.dtype,
            "block_size": self.vllm_block_size(),
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": self.enable_prefix_caching,
            "kv_transfer_config": {
                "kv_connector": "NixlConnector",
                "kv_role": KV_ROLE,
                "kv_buffer_device": "cpu" if self.on_cpu() else "cuda",
                "kv_load_failure_policy": self.failure_policy,
                "kv_connector_extra_config": {"kv_lease_duration": max(1, math.ceil(self.lease_s))},
            },
            "structured_outputs_config": dict(STRUCTURED_OUTPUTS),
        }
        if self.kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = vllm_kv_cache_dtype(self.kv_cache_dtype)
        if self.max_model_len:
            kw["max_model_len"] = self.max_model_len
        if self.max_num_batched_tokens:
            kw["max_num_batched_tokens"] = self.max_num_batched_tokens
        if not self.on_cpu():
            kw["kv_cache_memory_bytes"] = kv_memory_bytes(self.kv_memory)
        if self.record_kv_events:
            if not self.kv_events_endpoint:
                raise ValueError("record_kv_events needs kv_events_endpoint")
            kw["kv_events_config"] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,
                "topic": "kv",
            }
        kw.update({k: v for k, v in self.extra_args.items() if k != "block_size"})
        return kw


def default_nixl_port(http_port: int) -> int:
    """The NIXL side channel listens beside the HTTP port unless the operator says otherwise."""
    return http_port + 1 if http_port < 65535 else http_port - 1
