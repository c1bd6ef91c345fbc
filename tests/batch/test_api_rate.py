"""Batch API calls are bounded per team (`[batch] max_api_calls_per_minute`): a team polling
in a loop gets 429 `rate_limit_exceeded` with Retry-After, through the official openai client,
while another team's calls go on. Real HTTP against the batch routes (no model runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.batch.config import BatchConfig
from tests.batch.app import make_app
from tests.batch.conftest import client

LIMIT = 3


async def test_a_team_past_its_calls_waits(tmp_path: Path, serve: Any) -> None:
    config = BatchConfig(data_dir=tmp_path, max_api_calls_per_minute=LIMIT)
    url = await serve(make_app(config))
    async with client(url, "key-a") as a, client(url, "key-b") as b:
        for _ in range(LIMIT):
            await a.batches.list()
        with pytest.raises(openai.RateLimitError) as refused:
            await a.files.list()
        assert refused.value.code == "rate_limit_exceeded"
        assert 1 <= int(refused.value.response.headers["Retry-After"]) <= 60
        await b.batches.list()  # another team's own window
    # the simple form shares the team's window
    async with (
        aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as s,
        s.get(url + "/v1/batch/batch_x") as r,
    ):
        assert r.status == 429 and "Retry-After" in r.headers
