"""Scale-in of a decode node whose stream outlives the drain deadline: the actuator stops it
anyway (SIGTERM, as the local supervisor and Kubernetes do), the node's grace period ends the
stream with an error event (node/responder.py) and the gateway migrates it to the other decode
node — the client's answer is the uninterrupted one, token for token, with no error.

Real node processes (tiny random Llama, fp32, greedy), a real gateway, the official openai
client."""

from __future__ import annotations

import signal
from pathlib import Path

import aiohttp
import openai

from planner.drain import DrainEnd, Drainer
from tests.gateway.helpers import MODEL, make_team
from tests.gateway.test_migration import PROMPT, gateway, one_record, reference
from tests.procs import duet_node, running
from tests.wait import until

COMMON = ("--dtype", "float32", "--kv-blocks", "256", "--max-model-len", "1024")
MAX = 600


async def test_a_stream_past_the_drain_deadline_migrates(tmp_path: Path, tiny_llama: Path) -> None:
    d1 = duet_node("decode", tiny_llama, tmp_path, *COMMON, "--grace-period", "0")
    d2 = duet_node("decode", tiny_llama, tmp_path, *COMMON, "--grace-period", "0")
    with running(d1, d2):
        want = await reference(d2, tiny_llama, max_tokens=MAX)
        g = gateway(tmp_path, tiny_llama, decode=[d1.url, d2.url])
        with running(g):
            key = make_team(g.url, "m")
            client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
            stream = await client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=MAX,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            text, stopped = [], None
            async with aiohttp.ClientSession() as s:
                async for chunk in stream:
                    text.append(chunk.choices[0].text)
                    if stopped is None:  # the first token is out: scale the streaming node in
                        busy = []
                        for d in (d1, d2):
                            async with s.get(d.url + "/drain") as r:
                                busy += [d] if (await r.json())["inflight"] else []
                        assert len(busy) == 1
                        stopped = busy[0]
                        end = await Drainer(s, poll_s=0.05, deadline_s=0.0).drain(stopped.url)
                        assert end == DrainEnd.DEADLINE  # its stream is still running
                        stopped.proc.send_signal(signal.SIGTERM)  # the actuator's stop
            assert "".join(text) == want
            assert stopped is not None and stopped.proc.wait(30) == 0
            row = await one_record(g, key)
            assert row["migrations"] == 1 and sum(row["leg_tokens"]) == MAX, row
            other = d2 if stopped is d1 else d1
            await until(
                lambda: other.proc.poll() is None, what="the other decode node still serving"
            )
