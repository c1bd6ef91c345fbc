"""The spans of one node leg, from the timing the leg measured (node/responder.py's `timing`).

A leg measures its phases anyway (seconds since arrival, reported in its answer); when tracing
is on they become child spans of the leg's SERVER span once the leg has answered, so the hot
path pays nothing per token. What the leg does live (D's reserve and KV pull, decode/pull.py)
has live spans of its own.

- prefill leg: `prefill.queue` (arrival → first scheduled), `prefill.compute` (→ the KV is
  complete); its hold is a deferred span (`prefill.hold`, prefill/leg.py), ended by the release;
- decode leg: `decode.first_token` (KV ready → first token), `decode.generate` (→ last token);
- local leg (prefill on D, or a colocated node): `node.queue`, `node.prefill`, `node.decode`.
"""

from __future__ import annotations

from runtime.tracing import GEN_AI_INPUT_TOKENS, Tracing, mono_to_unix_ns


def record_leg(
    tracing: Tracing, kind: str | None, timing: dict[str, float], arrival: float, prompt_tokens: int
) -> None:
    """`kind`: the leg's trigger (prefill | decode) or None for a local leg."""
    if not tracing.enabled or "total_s" not in timing:
        return
    t0 = mono_to_unix_ns(arrival)

    def at(s: float) -> int:
        return t0 + int(s * 1e9)

    tracing.annotate({GEN_AI_INPUT_TOKENS: prompt_tokens, "duet.leg": kind or "local"})
    ttft, total = timing.get("ttft_s", 0.0), timing["total_s"]
    if kind == "decode":
        ready = timing.get("queue_s", 0.0) + timing.get("transfer_s", 0.0)
        tracing.record("decode.first_token", at(ready), at(ttft))
        tracing.record("decode.generate", at(ttft), at(total))
        return
    queue = timing.get("queue_s", 0.0)
    if kind == "prefill":
        tracing.record("prefill.queue", t0, at(queue))
        tracing.record("prefill.compute", at(queue), at(ttft), {GEN_AI_INPUT_TOKENS: prompt_tokens})
        return
    tracing.record("node.queue", t0, at(queue))
    tracing.record("node.prefill", at(queue), at(ttft), {GEN_AI_INPUT_TOKENS: prompt_tokens})
    tracing.record("node.decode", at(ttft), at(total))
