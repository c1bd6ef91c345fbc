"""The gateway's `/metrics` names every team with its spend, tokens and refusals, and it shares
the public listener: by default it answers only the admin key or the cluster secret (401 to
anyone else); `--open-metrics` is the operator's explicit choice to open it.

Real parts: the gateway app on a real socket in this process; `duet gateway`'s own argument
parser for the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from duet.security_args import add_gateway_security_arguments, plane_security
from gateway.app import make_app
from gateway.config import parse_config
from tests.gateway.helpers import ADMIN_KEY


async def test_gateway_metrics_need_a_credential_unless_opened(
    tiny_llama: Path, tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    add_gateway_security_arguments(parser)
    assert plane_security(parser.parse_args([])).protect_metrics
    opened = plane_security(parser.parse_args(["--open-metrics"]))
    assert not opened.protect_metrics
    cfg = parse_config(
        {
            "store": {"url": f"sqlite://{tmp_path / 'g.db'}"},
            "server": {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()},
            "models": {
                "tiny": {"tokenizer": str(tiny_llama), "static": {"both": ["http://127.0.0.1:9"]}}
            },
        }
    )
    async with TestClient(TestServer(make_app(cfg))) as client:
        assert (await client.get("/metrics")).status == 401
        wrong = {"Authorization": "Bearer sk-duet-not-the-admin-key"}
        assert (await client.get("/metrics", headers=wrong)).status == 401
        r = await client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status == 200 and "duet:" in await r.text()
        assert (await client.get("/health")).status == 200  # probes stay open
    cfg = dataclasses.replace(cfg, security=opened)
    async with TestClient(TestServer(make_app(cfg))) as client:
        assert (await client.get("/metrics")).status == 200
