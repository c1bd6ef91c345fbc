"""Agent frameworks against the gateway, as a team would build on it: pydantic-ai's `Agent` with
an OpenAI chat model pointed at `duet gateway` (a real node of the tiny model, fp32, greedy).

- Tool output (pydantic-ai's default): the framework offers its `final_result` tool with
  `tool_choice: required`, the gateway constrains the answer to a call of it (its parameters'
  schema, objects closed), and the framework validates the arguments into the Pydantic model.
- Native output: `response_format` json_schema (strict), the answer validated the same way.

The output model's fields are bounded (an enum, an integer range), so even the random tiny
model's constrained answer is whole, valid JSON within `max_tokens`; what is checked is the
wire between the framework and the gateway, not the model's taste. LlamaIndex and instructor
are not here: their current releases pin openai below the project's (llama-index-llms-openai
`openai<3`; instructor `jiter<0.15`, which openai 3 excludes), so they cannot install beside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.gateway.helpers import MODEL, gateway_proc, make_team, tiny_model
from tests.procs import TINY_NODE_ARGS, duet_node, running


class Pick(BaseModel):
    colour: Literal["red", "green", "blue"]
    n: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def gw(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("frameworks")
    node = duet_node("both", str(tiny_llama), tmp, *TINY_NODE_ARGS)
    g = gateway_proc(tmp, {MODEL: tiny_model(tiny_llama, both=[node.url])})
    with running(node, g):
        yield g.url, make_team(g.url, "frameworks")


@pytest.mark.parametrize("native", [False, True])
async def test_pydantic_ai_structured_output(gw: tuple[str, str], native: bool) -> None:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    url, key = gw
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url + "/v1", api_key=key))
    agent = Agent(
        model,
        output_type=NativeOutput(Pick) if native else Pick,
        model_settings={"max_tokens": 160, "temperature": 0},
        retries=0,
    )
    result = await agent.run("Pick a colour and a digit.")
    assert isinstance(result.output, Pick)
    usage = result.usage
    assert usage.requests == 1 and usage.input_tokens > 0 and usage.output_tokens > 0
    calls = [
        p
        for m in result.all_messages()
        for p in getattr(m, "parts", [])
        if type(p).__name__ == "ToolCallPart"
    ]
    # tool output is a call of the framework's own tool; native output is plain JSON text
    assert [c.tool_name for c in calls] == ([] if native else ["final_result"])
