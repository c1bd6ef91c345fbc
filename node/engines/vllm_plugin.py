"""duet's vLLM general plugin (entry point `vllm.general_plugins`): settings vLLM has no option
for, applied in every vLLM process (the node's, the engine core's, each worker's) when vLLM
loads its plugins, before any connector exists.

One today: the NIXL progress thread. vLLM's NixlConnector builds its agent with NIXL's default
progress thread, and NIXL's Python API hard-codes its delay to 0, which makes the thread
busy-poll: it spins a whole core per node whether or not anything moves (measured: an idle
`--engine vllm` node burned 1.0 core; two nodes on a 2-core machine starved everything else).
With a delay, NIXL's UCX backend sleeps in poll() on its workers' event fds and wakes on any
UCX event, or after the delay (NIXL's own workaround for fds that fail to wake). duet's own NIXL
transport never starts the thread (kvtransfer/nixl_transport.py).

The node passes its choice in `DUET_VLLM_NIXL_PROGRESS_THREAD` (node/engines/vllm_config.py):
- "0": no progress thread (a CPU decode node: it only reads, and vLLM's step progresses its
  reads);
- "poll:<µs>": the thread, sleeping in poll() between events (a CPU prefill or colocated node:
  its held blocks are read while its engine may be idle — with no thread at all, three
  concurrent guided prefill legs hung 120 s in the vLLM stage);
- anything else, or unset (vLLM run outside duet): vLLM's default, the spinning thread.
Loading twice is harmless (vLLM may load plugins several times per process).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

log = logging.getLogger("duet.vllm_plugin")

ENV = "DUET_VLLM_NIXL_PROGRESS_THREAD"


def register() -> None:
    mode = os.environ.get(ENV, "")
    if mode != "0" and not mode.startswith("poll:"):
        return
    try:
        api = importlib.import_module("nixl._api")  # what vllm.distributed.nixl_utils loads
    except ImportError:
        return  # no NIXL: vLLM's connector cannot start either, and says so itself
    if mode == "0":
        _no_progress_thread(api)
    else:
        _polling_progress_thread(api, int(mode.removeprefix("poll:")))


def _no_progress_thread(api: Any) -> None:
    base = api.nixl_agent_config
    if getattr(base, "_duet_no_progress_thread", False):
        return

    class NoProgressThreadConfig(base):  # type: ignore[misc, valid-type]  # a run-time base
        """nixl_agent_config whose progress thread is off unless the caller names it."""

        _duet_no_progress_thread = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if not args:  # enable_prog_thread is the first positional parameter
                kwargs.setdefault("enable_prog_thread", False)
            super().__init__(*args, **kwargs)

    api.nixl_agent_config = NoProgressThreadConfig
    log.info("NIXL agents in this vLLM process start without the progress thread (%s=0)", ENV)


class _PollingBindings:
    """nixl's native bindings module, except that every agent it makes gets `pthrDelay` (µs)
    instead of the 0 that nixl_agent.__init__ writes just before it calls `nixlAgent`."""

    _duet_polling = True

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real, self._delay_us = real, delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # the binding's own name
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def _polling_progress_thread(api: Any, delay_us: int) -> None:
    if getattr(api.nixlBind, "_duet_polling", False):
        return
    api.nixlBind = _PollingBindings(api.nixlBind, max(1, delay_us))
    log.info(
        "NIXL agents in this vLLM process poll for progress every %d µs at most, "
        "not in a spin (%s)",
        delay_us,
        ENV,
    )
