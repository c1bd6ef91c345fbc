"""A real `Executor` for the batch tests: sends each request to a real duet node process.

A chat body becomes a completion of the chat-templated prompt (token ids from
text.tokenizer.Tokenizer.encode_chat), and the node's answer is shaped back into a
chat.completion; a completion body goes to the node as it is. This is what the gateway's
executor does without quotas and routing; it is here so the batch tier is tested against a
real engine, not a canned answer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp

from text.tokenizer import Tokenizer

_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
)


class NodeExecutor:
    def __init__(self, session: aiohttp.ClientSession, node_url: str, model_dir: Path) -> None:
        self.session = session
        self.node_url = node_url
        self.tokenizer = Tokenizer(model_dir)
        self.calls: list[tuple[str, str]] = []  # (team, request id) of every call
        self.calls_by_user: list[str] = []  # body["user"] of every call that reached the node

    async def __call__(
        self,
        team_id: str,
        endpoint: str,
        body: dict[str, Any],
        *,
        tier: str = "batch",
        request_id: str,
    ) -> tuple[int, dict[str, Any]]:
        self.calls.append((team_id, request_id))
        if endpoint == "/v1/chat/completions":
            node_body = {k: body[k] for k in _SAMPLING if k in body}
            node_body["prompt"] = self.tokenizer.encode_chat(body["messages"])
            node_body["model"] = body["model"]
        else:
            node_body = {k: v for k, v in body.items() if k != "user"}
        node_body["priority"] = tier
        async with self.session.post(
            f"{self.node_url}/v1/completions", json=node_body, headers={"X-Request-Id": request_id}
        ) as r:
            data = await r.json()
        if "user" in body:  # the tests tag each request; this counts runs that reached the node
            self.calls_by_user.append(body["user"])
        if r.status != 200 or endpoint != "/v1/chat/completions":
            return r.status, data
        choice = data["choices"][0]
        return 200, {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": data["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": choice["text"]},
                    "finish_reason": choice["finish_reason"],
                }
            ],
            "usage": data.get("usage"),
        }
