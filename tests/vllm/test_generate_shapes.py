"""duet's `/inference/v1/generate` answers against vLLM's own code (the vLLM stage: needs vLLM
in the interpreter): the logprobs in vLLM's token-id form are what vLLM's generate server
builds from the same engine records (its sampler's dict per position, then its
`_create_tokens_logprobs`), and a whole answer and a stream's events parse as vLLM's
`GenerateResponse` and `GenerateStreamResponse`, field for field.

The records come from duet's engine function on random logits: greedy positions (the sampled
token is the likeliest), sampled positions outside the top tokens, and `logprobs` 0, 1 and 5.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from engine.sampler import token_logprobs
from protocol.generate import (
    GenerateChoice,
    GenerateChunk,
    GenerateResponse,
    generate_logprobs,
)
from protocol.logprobs import TokenLogprob
from protocol.openai import Usage

pytestmark = pytest.mark.usefixtures("need_vllm")


def _records(k: int, greedy: bool) -> list[TokenLogprob]:
    torch.manual_seed(k)
    logits = torch.randn(6, 50) * 3
    ids = logits.argmax(-1) if greedy else logits.argmin(-1)  # argmin: outside any top k
    return token_logprobs(logits, ids.tolist(), [k] * len(ids))


def _vllm_logprobs(records: list[TokenLogprob], k: int) -> dict[str, object]:
    """What vLLM's generate server answers for these records: its sampler's per-position dict
    (`append_logprobs_for_next_position`), then `ServingTokens._create_tokens_logprobs`."""
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs

    positions = create_sample_logprobs(flat_logprobs=False)
    for r in records:
        ids = [r.token_id, *(t for t, _ in r.top)]
        lps = [r.logprob, *(v for _, v in r.top)]
        assert r.rank is not None
        append_logprobs_for_next_position(positions, ids, lps, [None] * len(ids), r.rank, k)
    out = ServingTokens._create_tokens_logprobs(  # type: ignore[arg-type]
        None, [r.token_id for r in records], positions, num_output_top_logprobs=k
    )
    return json.loads(out.model_dump_json())


@pytest.mark.parametrize("k", [0, 1, 5])
@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_are_vllms_token_id_form(k: int, greedy: bool) -> None:
    records = _records(k, greedy)
    ours = msgspec.to_builtins(generate_logprobs(records))
    assert ours == _vllm_logprobs(records, k)


def test_answers_parse_as_vllms_generate_responses() -> None:
    from pydantic import TypeAdapter
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateResponse as VllmResponse,
    )
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateStreamResponse as VllmStreamResponse,
    )

    records = _records(2, True)
    ids = [r.token_id for r in records]
    choice = GenerateChoice(
        index=0, token_ids=ids, finish_reason="length", logprobs=generate_logprobs(records)
    )
    usage = Usage(prompt_tokens=3, completion_tokens=len(ids), total_tokens=3 + len(ids))
    whole = msgspec.json.encode(
        GenerateResponse(
            request_id="r",
            model="m",
            created=1,
            choices=[choice],
            usage=usage,
            prompt_token_ids=[1],
        )
    )
    parsed = TypeAdapter(VllmResponse).validate_json(whole)
    assert parsed.output_mode == "tokens"
    _read_back(json.loads(whole), json.loads(parsed.model_dump_json()))
    stream = TypeAdapter(VllmStreamResponse)
    for event in (
        GenerateChunk(request_id="r", choices=[choice], prompt_token_ids=[1]),
        GenerateChunk(request_id="r", choices=[], usage=usage),
    ):
        raw = msgspec.json.encode(event)
        got = json.loads(stream.validate_json(raw).model_dump_json())
        assert got["output_mode"] == "tokens"
        _read_back(json.loads(raw), got)


def _read_back(sent: object, back: object) -> None:
    """Every field duet sent is read back by vLLM's model as sent (vLLM's own optional fields,
    unset here, come back at their defaults)."""
    if isinstance(sent, dict):
        assert isinstance(back, dict)
        for f, v in sent.items():
            _read_back(v, back[f])
    elif isinstance(sent, list):
        assert isinstance(back, list) and len(back) == len(sent)
        for a, b in zip(sent, back, strict=True):
            _read_back(a, b)
    else:
        assert sent == back
