"""`Resume`: a migrated request's continuation point (stream migration, DESIGN §8).

When the decode node of a request dies after tokens went out, the gateway sends the request to
another node with the tokens already streamed appended to the prompt, and this struct on the leg
(`NodeCompletionRequest.resume`, then `SamplingParams.resume`) says so. The node then treats the
last `output_tokens` prompt ids as the request's own output so far:

- text: the engine replays them through the same incremental detokenizer and stop-string state
  the dead node ran (from the same original prompt), and emits only what lies beyond the first
  `text_chars` characters, which the client already has — no missing leading space, no split
  UTF-8 character, no stop string missed across the seam;
- limits: `max_tokens` and `min_tokens` on the leg are the original request's and count those
  tokens (the node subtracts them);
- a seeded sampler draws as if it had sampled them (the native engine advances the request's
  generator by `output_tokens` draws), so a seeded request continues the same sequence;
- usage: the answer reports the original prompt's tokens and only the newly generated ones.

Invariant: 0 < output_tokens < len(prompt) and 0 <= text_chars; a node checks it (400).
"""

from __future__ import annotations

import msgspec


class Resume(msgspec.Struct, frozen=True, kw_only=True):
    #: the last `output_tokens` ids of the leg's prompt are output the client has already seen
    output_tokens: int
    #: characters of their text (Python str length) already delivered to the client; the rest,
    #: held back by the dead node (an incomplete character, a possible stop string), comes next
    text_chars: int
    #: which migration of the request this leg is (1 = the first); mirrored in X-Duet-Migration
    migration: int = 1
