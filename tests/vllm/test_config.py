"""`--engine vllm` flags → VllmEngineConfig → vLLM's engine arguments and environment. Pure:
runs without vLLM (the config module never imports it)."""

from __future__ import annotations

import argparse

import pytest

from duet.cmd_nodes import add_node_arguments, node_config, role_registrations
from node.engines.vllm_config import VllmEngineConfig, kv_memory_bytes, parse_vllm_args
from node.legs import Roles


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_node_arguments(p, 8100)
    return p.parse_args(list(argv))


@pytest.fixture
def vllm_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config is built without vLLM; only the presence check looks for it."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name in ("vllm", "nixl") else real(name, *a),
    )


def test_node_flags_map_onto_vllm(vllm_importable: None) -> None:
    args = parse(
        "--engine",
        "vllm",
        "--model",
        "m",
        "--port",
        "9000",
        "--failure-policy",
        "fail",
        "--lease-seconds",
        "12.5",
        "--kv-blocks",
        "64",
        "--device",
        "cpu",
        "--vllm-arg",
        "enforce_eager=true",
        "--vllm-arg",
        "max-num-seqs=4",
        "--vllm-arg",
        'compilation_config={"mode": 0}',
        "--vllm-arg",
        "tokenizer_mode=auto",
    )
    cfg = node_config(args, "decode")
    e = cfg.engine
    assert isinstance(e, VllmEngineConfig) and cfg.engine_kind == "vllm"
    assert e.nixl_port == 9001 and e.nixl_host == "127.0.0.1"
    kw = e.engine_kwargs("/models/m")
    kt = kw["kv_transfer_config"]
    assert (
        kt["kv_connector"] == "NixlConnector"
        and kt["kv_role"] == "kv_both"
        and kt["kv_buffer_device"] == "cpu"
    )
    assert kt["kv_load_failure_policy"] == "fail"
    assert (
        kt["kv_connector_extra_config"]["kv_lease_duration"] == 13
    )  # whole seconds, never shorter
    assert (
        kw["enforce_eager"] is True
        and kw["max_num_seqs"] == 4
        and kw["compilation_config"] == {"mode": 0}
    )
    assert kw["tokenizer_mode"] == "auto" and kw["num_gpu_blocks_override"] == 64
    assert "kv_events_config" not in kw
    assert kw["block_size"] == 32  # vLLM's CPU attention needs multiples of 32; duet hashes 16
    assert e.vllm_block_size() == 32 and e.block_size == 16
    env = e.environment()
    assert (
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "9001"
        and env["VLLM_NIXL_ABORT_REQUEST_TIMEOUT"] == "13"
    )
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["HF_HUB_OFFLINE"] == "1"


def test_structured_outputs_use_llguidance_and_compact_json() -> None:
    """vLLM's guidance backend (the gateway's and the native engine's grammar engine)
    with compact JSON by default; a --vllm-arg replaces it."""
    e = VllmEngineConfig(model="m", device="cpu")
    assert e.engine_kwargs("/m")["structured_outputs_config"] == {
        "backend": "guidance",
        "disable_any_whitespace": True,
    }
    e = VllmEngineConfig(
        model="m", device="cpu", extra_args={"structured_outputs_config": {"backend": "xgrammar"}}
    )
    assert e.engine_kwargs("/m")["structured_outputs_config"] == {"backend": "xgrammar"}


def test_kv_events_need_an_endpoint_and_go_to_zmq() -> None:
    e = VllmEngineConfig(model="m", device="cpu", record_kv_events=True)
    with pytest.raises(ValueError, match="kv_events_endpoint"):
        e.engine_kwargs("/m")
    e.kv_events_endpoint = "ipc:///tmp/x"
    assert e.engine_kwargs("/m")["kv_events_config"]["endpoint"] == "ipc:///tmp/x"


@pytest.mark.parametrize(
    "bad", ["novalue", "=3", "model=other", "kv_transfer_config={}", "not a name=1"]
)
def test_bad_vllm_args_are_usage_errors(bad: str) -> None:
    with pytest.raises(ValueError, match="--vllm-arg"):
        parse_vllm_args([bad])


def test_missing_vllm_is_a_usage_error() -> None:
    import importlib.util

    if (
        importlib.util.find_spec("vllm") is not None
        and importlib.util.find_spec("nixl") is not None
    ):
        pytest.skip("vLLM is installed here")
    with pytest.raises(ValueError, match="scripts/setup --vllm"):
        node_config(parse("--engine", "vllm"), "both")


def test_vllm_flags_need_the_vllm_engine() -> None:
    with pytest.raises(ValueError, match="only with --engine vllm"):
        node_config(parse("--vllm-arg", "enforce_eager=true"), "both")
    with pytest.raises(ValueError, match="multiple of --block-size"):
        VllmEngineConfig(model="m", device="cpu", extra_args={"block_size": 24}).vllm_block_size()
    assert VllmEngineConfig(model="m", device="cuda", block_size=16).vllm_block_size() == 16
    with pytest.raises(ValueError, match="failure policy"):
        VllmEngineConfig(model="m", failure_policy="retry")
    assert kv_memory_bytes("512MiB") == 512 << 20 and kv_memory_bytes("2GB") == 2 * 10**9
    with pytest.raises(ValueError):
        kv_memory_bytes("lots")


def test_vllm_roles_register_pass_through_legs() -> None:
    roles = Roles()
    for reg in role_registrations("both", "vllm"):
        reg(roles)
    assert set(roles.legs) == {"do_remote_decode", "do_remote_prefill"}
    assert all(h.__module__ == "node.engines.vllm_legs" for h in roles.legs.values())
    native = Roles()
    for reg in role_registrations("prefill"):
        reg(native)
    assert native.legs["do_remote_decode"].__module__ == "prefill.leg"


def test_nixl_progress_thread_is_off_on_cpus_by_default(vllm_importable: None) -> None:
    """vLLM's NIXL agents start NIXL's progress thread, which spins a core per node: off on CPU
    decode nodes unless asked for, polling on CPU prefill and colocated nodes, vLLM's default on
    GPUs, and the operator's word wins either way."""

    def env(*flags: str, device: str = "cpu", role: str = "decode") -> dict[str, str]:
        args = parse("--engine", "vllm", "--model", "m", "--device", device, *flags)
        return node_config(args, role).engine.environment()

    assert env()["DUET_VLLM_NIXL_PROGRESS_THREAD"] == "0"
    assert env(role="prefill")["DUET_VLLM_NIXL_PROGRESS_THREAD"] == "poll:1000"
    assert env(role="both")["DUET_VLLM_NIXL_PROGRESS_THREAD"] == "poll:1000"
    assert env(device="cuda")["DUET_VLLM_NIXL_PROGRESS_THREAD"] == "1"
    assert env(device="cuda", role="prefill")["DUET_VLLM_NIXL_PROGRESS_THREAD"] == "1"
    assert env("--vllm-nixl-progress-thread", "on")["DUET_VLLM_NIXL_PROGRESS_THREAD"] == "1"
    assert (
        env("--vllm-nixl-progress-thread", "poll", device="cuda")["DUET_VLLM_NIXL_PROGRESS_THREAD"]
        == "poll:1000"
    )
    assert (
        env("--vllm-nixl-progress-thread", "off", device="cuda")["DUET_VLLM_NIXL_PROGRESS_THREAD"]
        == "0"
    )
    with pytest.raises(ValueError, match="only with --engine vllm"):
        node_config(parse("--vllm-nixl-progress-thread", "off"), "both")


def test_the_vllm_plugin_turns_nixls_progress_thread_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """node/engines/vllm_plugin.py, the entry point vLLM loads in each of its processes: with the
    node's "0" a config built as vLLM builds it has no progress thread; an explicit choice stands;
    unset (vLLM outside duet) changes nothing; loading twice wraps once."""
    import importlib
    from importlib.metadata import entry_points

    from node.engines import vllm_plugin

    api = pytest.importorskip("nixl._api")
    assert any(
        ep.value == "node.engines.vllm_plugin:register"
        for ep in entry_points(group="vllm.general_plugins")
    )
    monkeypatch.setattr(api, "nixl_agent_config", api.nixl_agent_config)  # restored after the test
    original = api.nixl_agent_config
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    vllm_plugin.register()
    assert api.nixl_agent_config is original and original(num_threads=4).enable_pthread is True
    monkeypatch.setenv(vllm_plugin.ENV, "0")
    vllm_plugin.register()
    vllm_plugin.register()
    cfg = importlib.import_module("nixl._api").nixl_agent_config
    assert cfg.__mro__[1] is original  # wrapped once
    assert cfg(num_threads=4, capture_telemetry=True).enable_pthread is False
    assert cfg(enable_prog_thread=True).enable_pthread is True


def test_the_vllm_plugin_makes_a_polling_progress_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the node's "poll:<µs>" every NIXL agent vLLM makes keeps its progress thread but gets
    that delay instead of the 0 (a busy spin) nixl's Python API writes; a real agent with a UCX
    backend starts that way; loading twice wraps once."""
    import importlib

    from node.engines import vllm_plugin

    api = pytest.importorskip("nixl._api")
    monkeypatch.setattr(api, "nixlBind", api.nixlBind)  # restored after the test
    real = api.nixlBind
    seen: list[tuple[bool, int]] = []
    spy = real.nixlAgent

    def recording(name, config):  # type: ignore[no-untyped-def]
        seen.append((config.useProgThread, config.pthrDelay))
        return spy(name, config)

    monkeypatch.setattr(real, "nixlAgent", recording)
    monkeypatch.setenv(vllm_plugin.ENV, "poll:1000")
    vllm_plugin.register()
    vllm_plugin.register()
    bind = importlib.import_module("nixl._api").nixlBind
    assert bind._real is real  # wrapped once
    agent = api.nixl_agent("duet-poll-test", api.nixl_agent_config(backends=["UCX"]))
    assert seen == [(True, 1000)]
    assert "UCX" in agent.backends


def test_kv_cache_dtype_maps_to_vllms_own(vllm_importable: None) -> None:
    """fp8 passes through as vLLM's kv_cache_dtype; int8 (the native engine's) is refused with
    what to use instead; auto leaves vLLM's default alone."""
    base = ("--engine", "vllm", "--model", "m", "--device", "cpu")
    kw = node_config(parse(*base, "--kv-cache-dtype", "fp8"), "decode").engine.engine_kwargs("/m")
    assert kw["kv_cache_dtype"] == "fp8"
    kw = node_config(parse(*base), "decode").engine.engine_kwargs("/m")
    assert "kv_cache_dtype" not in kw
    with pytest.raises(ValueError, match="vLLM has no int8 KV cache: use --kv-cache-dtype fp8"):
        node_config(parse(*base, "--kv-cache-dtype", "int8"), "decode")
