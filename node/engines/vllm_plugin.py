"""duet's vLLM general plugin (entry point `vllm.general_plugins`): settings vLLM has no option
for, applied in every vLLM process (the node's, the engine core's, each worker's) when vLLM
loads its plugins, before any connector exists.

One today: the NIXL progress thread. vLLM's NixlConnector builds its agent with NIXL's default
progress thread, which spins a whole core per node whether or not anything moves (measured: an
idle `--engine vllm` node burned 1.0 core; two nodes on a 2-core machine starved everything
else). duet's own NIXL transport never starts it (kvtransfer/nixl_transport.py). A vLLM
decode node only reads, and vLLM's step progresses its reads, so by default duet turns the
thread off there on CPUs. A prefill node keeps it: its held blocks are read while its engine may
be idle, and with the thread off three concurrent guided prefill legs hung for 120 s in the vLLM
stage (its worker stopped answering the engine core).

The node passes its choice in `DUET_VLLM_NIXL_PROGRESS_THREAD` (node/engines/vllm_config.py):
"0" turns the thread off, anything else (or unset: vLLM run outside duet) leaves vLLM's default.
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
    if os.environ.get(ENV) != "0":
        return
    try:
        api = importlib.import_module("nixl._api")  # what vllm.distributed.nixl_utils loads
    except ImportError:
        return  # no NIXL: vLLM's connector cannot start either, and says so itself
    base = api.nixl_agent_config
    if getattr(base, "_duet_no_progress_thread", False):
        return

    class NoProgressThreadConfig(base):  # type: ignore[misc, valid-type]
        """nixl_agent_config whose progress thread is off unless the caller names it."""

        _duet_no_progress_thread = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if not args:  # enable_prog_thread is the first positional parameter
                kwargs.setdefault("enable_prog_thread", False)
            super().__init__(*args, **kwargs)

    api.nixl_agent_config = NoProgressThreadConfig
    log.info("NIXL agents in this vLLM process start without the progress thread (%s=0)", ENV)
