"""Where a request's cacheable prefix ends, in tokens: the `KVRetain` its node legs carry.

A client marks the end of a prefix it will send again (Anthropic's `cache_control` on a tool, a
system block or a message's content block; gateway/api/anthropic/cache_marks.py) as a
`RetainMark` (gateway/serving/requests.py):
the chat messages the prefix spans and the ttl. Only the rendered prompt says how many tokens
that is, so once the prompt is measured the prefix messages are rendered alone (no generation
prompt) and the retained tokens are the ones both renderings share, cut to whole KV blocks —
what the nodes can keep. A template that renders a turn differently once another follows it only
makes the shared part shorter: what is retained is always a real prefix of the prompt.

A breakpoint inside a turn (one content block of several) covers the whole turn: the gateway
joins a turn's blocks into one chat message before rendering.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gateway.serving.requests import Request
from gateway.tools.plan import ToolPlan
from gateway.tools.prompt import render
from protocol.retention import KVRetain
from text.tokenizer import ChatTemplateError

if TYPE_CHECKING:  # a layer above (the backends' seam)
    from gateway.backends.base import ServedModel

log = logging.getLogger("duet.gateway")


def _shared(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def retain_for(
    served: ServedModel, req: Request, ids: list[int], plan: ToolPlan | None
) -> KVRetain | None:
    """The retention `req` asks for on its prompt `ids` (None: nothing to keep on this model:
    no mark, an external model, or a prefix shorter than one KV block)."""
    tok, mark = served.tokenizer, req.retain
    if mark is None or tok is None or req.messages is None:
        return None
    head = req.messages[: mark.messages]
    try:
        if plan is None:
            text = tok.apply_chat_template(head, add_generation_prompt=False)
        else:
            text = render(tok, head, plan, add_generation_prompt=False)
    except ChatTemplateError as e:  # a template that renders no partial conversation
        log.warning(
            "%s: cache_control ignored, its prefix does not render: %s", served.config.name, e
        )
        return None
    bs = served.config.block_size
    tokens = _shared(tok.encode(text, add_special_tokens=False), ids) // bs * bs
    return KVRetain(tokens=tokens, ttl_s=mark.ttl.seconds) if tokens else None
