"""`duet prefill`, `duet decode`, `duet node`: run one node process.

Their flags are generated from the node's settings (node.config.NodeConfig, engine.config.
EngineConfig, node.engines.vllm_config.VllmOptions, runtime.read_deadlines.ReadDeadlines) by
duet/config_flags.py, one group per class; the cluster security and etcd client flags are the
ones every process shares.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING

from coordinator.etcd_auth import add_etcd_arguments, apply_etcd_args
from duet.config_flags import add_config_flags, add_deprecated_aliases, config_kwargs
from duet.errors import UsageError
from duet.security_args import add_server_arguments, plane_security, read_deadlines

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from node.config import NodeConfig
    from node.engines.vllm_config import VllmEngineConfig, VllmOptions

ROLE_HELP = {
    "prefill": ("prefill node: computes prompts' KV and holds it for decode nodes", 8100),
    "decode": ("decode node: pulls KV from prefill nodes and streams tokens", 8200),
    "node": (
        "a node of any role; --role both runs prefill and decode in one engine "
        "(colocated, the baseline for disaggregation)",
        8300,
    ),
}


#: old spellings of the node's flags: they still work, with one warning per process
DEPRECATED = {
    "--lease-seconds": "--lease-s",
    "--transfer-timeout": "--transfer-timeout-s",
    "--reserve-timeout": "--reserve-timeout-s",
    "--grace-period": "--grace-period-s",
}

#: NodeConfig fields that are no flag, and why
NODE_SKIP = {
    "engine": "the engine's settings: the engine group (EngineConfig, VllmOptions)",
    "security": "the cluster security group, shared with every process (duet/security_args.py)",
    "deadlines": "the slow clients group (ReadDeadlines)",
}
#: EngineConfig fields that are no flag, and why
ENGINE_SKIP = {
    "hash_seed": "every process of a cluster must hash blocks alike (protocol/block_hash.py)",
    "record_kv_events": "on exactly when the node registers with etcd (--etcd)",
}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, (what, port) in ROLE_HELP.items():
        p = sub.add_parser(
            name,
            help=what,
            description=what + ". Serves the internal node API: "
            "POST /v1/completions, GET /kv/metadata, POST /kv/release, POST /abort, "
            "GET /kv/snapshot, GET /health, GET /metrics.",
        )
        add_node_arguments(p, port, with_role=name == "node")
        p.set_defaults(func=_run, fixed_role=None if name == "node" else name)


def add_node_arguments(p: argparse.ArgumentParser, port: int, with_role: bool = False) -> None:
    """Every flag of a node process: NodeConfig's, EngineConfig's, VllmOptions', the read
    deadlines', the cluster security and etcd client flags. `--role` only with `with_role`
    (`duet node`; `duet prefill` and `duet decode` are their role)."""
    from engine.config import EngineConfig
    from node.config import NodeConfig
    from node.engines.vllm_config import VllmOptions

    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    role = {} if with_role else {"role": "the command is the role: duet prefill | duet decode"}
    node = p.add_argument_group("node")
    add_config_flags(node, NodeConfig, skip={**NODE_SKIP, **role}, defaults={"port": port})
    add_etcd_arguments(p.add_argument_group("etcd client (with --etcd)"))
    add_config_flags(p.add_argument_group("engine"), EngineConfig, skip=ENGINE_SKIP)
    add_config_flags(p.add_argument_group("vLLM engine (--engine vllm)"), VllmOptions)
    add_server_arguments(p)
    add_deprecated_aliases(p, DEPRECATED)


def node_config(args: argparse.Namespace, role: str | None = None) -> NodeConfig:
    """The node's settings from its flags; `role` fixes the role (`duet prefill`). Raises
    ValueError for a combination that cannot run."""
    from coordinator.store import parse_etcd_url
    from engine.config import EngineConfig
    from node.config import NodeConfig
    from node.engines.vllm_config import VllmOptions

    given = config_kwargs(NodeConfig, args) | ({"role": role} if role else {})
    if given.get("etcd"):
        parse_etcd_url(given["etcd"])  # a typo is a usage error now, not a registration retry loop
    apply_etcd_args(args)
    cfg = NodeConfig(**given, security=plane_security(args), deadlines=read_deadlines(args))
    engine_given = config_kwargs(EngineConfig, args)
    engine = EngineConfig(**engine_given, record_kv_events=cfg.etcd is not None)
    engine = _spill_dir(engine, cfg)
    vllm_given = config_kwargs(VllmOptions, args)
    if cfg.task == "embed" and cfg.engine_kind != "native":
        raise ValueError(
            "--task embed needs --engine native (the vllm adapter serves generation only)"
        )
    if cfg.task != "embed" and "pooling" in given:
        raise ValueError("--pooling applies only with --task embed")
    if engine.itl_target_ms is not None and (
        cfg.engine_kind != "native" or not engine.itl_target_ms > 0
    ):
        raise ValueError(
            "--itl-target-ms takes a positive number of milliseconds, with --engine native"
        )
    if cfg.engine_kind != "native" and (engine.max_loras or cfg.sleep_after_idle_s is not None):
        raise ValueError("--max-loras and --sleep-after-idle-s apply only with --engine native")
    if cfg.engine_kind == "vllm" and (engine.kv_host_bytes or engine.kv_disk_dir):
        raise ValueError("--kv-host-bytes and --kv-disk-bytes apply only with --engine native")
    if cfg.engine_kind == "vllm":
        batched = "max_num_batched_tokens" in engine_given
        return replace(
            cfg, engine=vllm_engine_config(cfg, engine, VllmOptions(**vllm_given), batched)
        )
    if vllm_given:
        raise ValueError(
            "--vllm-arg, --nixl-port and --vllm-nixl-progress-thread apply only with --engine vllm"
        )
    return replace(cfg, engine=engine)


def _spill_dir(engine: EngineConfig, node: NodeConfig) -> EngineConfig:
    """A disk tier without a directory gets this node's own: $DUET_HOME/kv-spill/NODE_ID; no
    tier (a budget of 0), no directory."""
    from engine.config import parse_size
    from runtime.models import duet_home

    if not parse_size(engine.kv_host_bytes):
        engine = replace(engine, kv_host_bytes=0)
    if not parse_size(engine.kv_disk_bytes):
        return replace(engine, kv_disk_bytes=0, kv_disk_dir=None)
    if engine.kv_disk_dir is None:
        engine = replace(engine, kv_disk_dir=str(duet_home() / "kv-spill" / node.resolved_node_id))
    return engine


def vllm_engine_config(
    node: NodeConfig, engine: EngineConfig, opts: VllmOptions, batched_given: bool
) -> VllmEngineConfig:
    """duet's node and engine settings in vLLM's terms (node.engines.vllm_config documents the
    mapping). `batched_given`: the operator set --max-num-batched-tokens (else vLLM sizes its
    own budget: duet's native default is not sized for it)."""
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
    extra = parse_vllm_args(opts.vllm_args)
    if engine.num_kv_blocks is not None:
        extra.setdefault("num_gpu_blocks_override", engine.num_kv_blocks)
    thread = opts.vllm_nixl_progress_thread
    return VllmEngineConfig(
        model=engine.model,
        role=node.role,
        dtype=engine.dtype,
        device=engine.device,
        block_size=engine.block_size,
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens if batched_given else None,
        enable_prefix_caching=engine.enable_prefix_caching,
        kv_memory=engine.kv_memory,
        kv_cache_dtype=engine.kv_cache_dtype,
        threads=engine.threads,
        lease_s=node.lease_s,
        failure_policy=node.failure_policy,
        nixl_host=node.public_host,
        nixl_port=opts.nixl_port or default_nixl_port(node.port),
        record_kv_events=engine.record_kv_events,
        nixl_progress_thread=None if thread == "auto" else thread,
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
    from node.request_log import setup_logging
    from node.server import run_node

    try:
        cfg = node_config(args, args.fixed_role)
    except ValueError as e:
        raise UsageError(str(e)) from None
    setup_logging(args.log_level, name=cfg.role)
    try:
        return run_node(cfg, role_registrations(cfg.role, cfg.engine_kind, cfg.task))
    except ValueError as e:  # engine sizing errors: pool too small, bad dtype...
        raise UsageError(str(e)) from None
