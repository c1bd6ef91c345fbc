"""UCX settings for KV transfers: what duet sets, what it leaves alone, and why (measured).

Measured with `python -m bench.kvtransfer --sweep-ucx` (two processes, one host, SmolLM2
blocks; numbers in kvtransfer/README.md):

- nixl: UCX's own transport choice is already the fastest on one host. For a READ it picks
  `cma` (process_vm_readv: one kernel copy, zero-copy on both sides). Without cma (UCX_TLS
  with only posix/sysv/tcp) the READ went over TCP loopback, 6-10x slower. Restricting UCX_TLS to
  `cma,tcp,self` or `sm,tcp,self` measured the same as the default within noise, and would disable
  RDMA between hosts. So duet sets no UCX_TLS: UCX keeps cma (or cuda_ipc for GPU memory) within a
  host and RDMA (rc/dc/ud over InfiniBand or RoCE) between hosts. What did matter, and is duet's
  default:
    * no NIXL progress thread: it busy-polls a core; with it on, 64-256 block reads lost
      45-70% of their bandwidth on 2 cores (the loop polls instead, see nixl_transport.py);
    * huge pages on the pools (kvtransfer/memory.py): cma pins pages per call; with 2 MiB
      pages 64-256 block reads went from 60-77% to 95-105% of memcpy;
    * small reads posted inline on the event loop, large ones on the agent thread
      (`inline_max_bytes`): a thread hop cost ~0.2 ms here, more than a 1-block copy.
- ucx (ucxx): ucxx's client/server endpoints need UCX error handling, with which the UCX
  1.21 of the `libucx-cu12` wheel keeps shared memory and cma out of tagged messages: data
  goes over TCP loopback even on one host (~1 GB/s here). Neither the legacy protocol
  selection (PROTO_ENABLE=n) nor larger TCP segments changed that beyond the noise of a
  shared 2-core host, so `UCXX_DEFAULT_OPTIONS` is empty; options given to the transport go
  to ucxx's own UCX context only (never exported, so NIXL in the same process is unaffected),
  and UCX_* environment variables override them. Endpoints without error handling would get
  sysv + cma (~2.4 GB/s measured) but a dying peer could then hang or abort the reader.

RDMA between hosts (both backends; set in the environment of P and D):
    UCX_TLS                unset, or e.g. "rc,ud,cma,cuda_copy,cuda_ipc,tcp,self";
                           never a list without an RDMA transport (rc/dc/ud).
    UCX_NET_DEVICES        the HCA ports to use, e.g. "mlx5_0:1,mlx5_1:1" (default: all).
    UCX_IB_GPU_DIRECT_RDMA yes (default try) for VRAM pools: NIC reads GPU memory directly.
    UCX_MAX_RMA_RAILS      2-4 to stripe one READ over several NICs.
    UCX_IB_SL / UCX_IB_TRAFFIC_CLASS  QoS on a shared fabric.
    UCX_RC_TIMEOUT / UCX_RC_RETRY_COUNT  how fast a dead peer is detected on RC.
Without RDMA between hosts (TCP only), NIXL's READ is emulated with messages the owner's
worker must answer: start its transport with `progress_thread=True` there.
The `libucx-cu12` wheel (ucx backend) is built without verbs/rdmacm: the ucx backend does
not do RDMA unless ucxx is rebuilt against a system UCX with InfiniBand support.

On one host, cma needs the two processes to see each other's pids (same PID namespace: in
containers share it) and ptrace permission: with /proc/sys/kernel/yama/ptrace_scope 0 or 1
UCX enables it (it calls PR_SET_PTRACER itself for 1); 2 needs CAP_SYS_PTRACE; 3 disables
cma and reads fall back to TCP loopback.
"""

from __future__ import annotations

import os

#: UCX options (without the UCX_ prefix) for ucxx's context; the environment overrides them.
UCXX_DEFAULT_OPTIONS: dict[str, str] = {}

#: UCX variables worth reporting next to transfer measurements.
REPORTED_PREFIXES = ("UCX_", "NIXL_", "UCXPY_")


def ucx_environment() -> dict[str, str]:
    """The UCX/NIXL settings in this process's environment (for logs and bench reports)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(REPORTED_PREFIXES)}
