"""`python -m tests.batch.serve`: the batch test app as its own process (for SIGKILL tests)."""

from __future__ import annotations

import argparse
from pathlib import Path

from aiohttp import web

from gateway.batch.config import BatchConfig
from tests.batch.app import make_app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--node-url", required=True)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--lease-s", type=float, default=5.0)
    ap.add_argument("--poll-s", type=float, default=0.1)
    a = ap.parse_args()
    config = BatchConfig(
        data_dir=a.data_dir,
        worker_id=a.worker_id,
        concurrency=a.concurrency,
        lease_s=a.lease_s,
        poll_s=a.poll_s,
        retry_base_s=0.1,
    )
    web.run_app(
        make_app(config, node_url=a.node_url, model_dir=a.model_dir),
        host="127.0.0.1",
        port=a.port,
        print=None,
    )


if __name__ == "__main__":
    main()
