"""What the P/D tests assert about the KV pull itself, beyond equal tokens (DESIGN §6).

Equal tokens alone prove little: with the default failure policy a broken pull is hidden by
`recompute` (D prefills locally and answers the same tokens). So a P/D test also checks,
from outside the nodes:
- which transport ran: the "KV transport: <backend>" line of both nodes' logs;
- that no pull failed: `duet:kv_transfer_failures_total` (all reasons) stays 0 and D logged
  no "KV pull failed";
- that every request's blocks really moved: D's "[request id] ... pulled N blocks" line names
  the expected N (the prompt's blocks less those D's prefix cache had, which must be a prefix
  another prompt of the test shares), and `duet:kv_transfer_bytes_total` grew by exactly the
  pulled blocks x block bytes, the block size read from P's own `/kv/metadata` layout.
"""

from __future__ import annotations

import re
import urllib.request

from bench.pd_client import Result
from bench.procs import Proc
from kvtransfer import decode_metadata
from protocol.kv_layout import KVLayout


def metrics_text(node: Proc) -> str:
    return urllib.request.urlopen(node.url + "/metrics", timeout=5).read().decode()


def metric_sum(node: Proc, name: str) -> float:
    """The sum of every series of `name` (0 when none exists yet, e.g. a labelled counter)."""
    values = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", metrics_text(node), re.M)
    return sum(float(v) for v in values)


def layout_of(node: Proc) -> KVLayout:
    body = urllib.request.urlopen(node.url + "/kv/metadata", timeout=5).read()
    return decode_metadata(body).layout


def transport_of(node: Proc) -> str:
    found = re.findall(r"KV transport: (\w+)", node.log())
    assert len(found) == 1, f"expected one 'KV transport:' line in the log, got {found}"
    return found[0]


def pulled_blocks(log: str, request_id: str) -> int:
    found = re.findall(rf"\[{re.escape(request_id)}\].* pulled (\d+) blocks", log)
    assert len(found) == 1, f"D logged {len(found)} pulls for {request_id} (a recompute logs none)"
    return int(found[0])


class PullCheck:
    """Snapshot D's counters before some P → D requests; `verify` asserts what they moved."""

    def __init__(self, p: Proc, d: Proc, backend: str = "nixl") -> None:
        assert transport_of(p) == backend and transport_of(d) == backend
        self.p, self.d = p, d
        self.layout = layout_of(p)
        assert layout_of(d).block_bytes == self.layout.block_bytes
        self.bytes0 = metric_sum(d, "duet:kv_transfer_bytes_total")
        self.failures0 = metric_sum(d, "duet:kv_transfer_failures_total")
        self.log0 = len(d.log())  # earlier tests on a shared D may have failed pulls on purpose

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.block_size)

    def shared_blocks(self, prompt: list[int], others: list[list[int]]) -> int:
        """Full blocks of `prompt` that another prompt starts with too: the most D's prefix
        cache can serve it (never the block of the last token, which is always computed)."""
        bs, best = self.layout.block_size, 0
        for o in others:
            if o is prompt:
                continue
            n = 0
            while n < min(len(o), len(prompt)) and o[n] == prompt[n]:
                n += 1
            best = max(best, n // bs)
        return min(best, (len(prompt) - 1) // bs)

    def verify(self, results: list[Result], prompts: list[list[int]]) -> int:
        """`results` of P → D requests for `prompts`, pairwise. Every pull succeeded and moved
        exactly the blocks D did not have cached (D's usage says how many tokens it had; a
        cached block must be a prefix another prompt shares). Returns the bytes moved."""
        assert len(results) == len(prompts)
        assert metric_sum(self.d, "duet:kv_transfer_failures_total") == self.failures0
        log = self.d.log()[self.log0 :]
        assert "KV pull failed" not in log, log
        bs, blocks = self.layout.block_size, 0
        for r, x in zip(results, prompts, strict=True):
            assert r.usage is not None, f"{r.request_id}: no usage"
            cached = r.usage["prompt_tokens_details"]["cached_tokens"]
            assert cached % bs == 0 and cached // bs <= self.shared_blocks(x, prompts), (
                r.request_id,
                cached,
            )
            got = pulled_blocks(log, r.request_id)
            want = self.blocks_for(len(x)) - cached // bs
            assert got == want, (
                f"{r.request_id}: pulled {got} blocks for a {len(x)}-token prompt, {cached} cached"
            )
            blocks += got
        moved = metric_sum(self.d, "duet:kv_transfer_bytes_total") - self.bytes0
        assert moved == blocks * self.layout.block_bytes, (moved, blocks, self.layout.block_bytes)
        return int(moved)
