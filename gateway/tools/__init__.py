"""Tool calling for self-hosted models: the gateway renders the tools into the
prompt (the model's own chat template when it has tools, else duet's generic tool prompt,
docs/tools.md), enforces `tool_choice` = required / a named function with a guide, and parses
the model's text back into OpenAI's `tool_calls`, whole or streamed.

One module per concern: `events` (what a parser emits), `hermes` and `llama3_json` (the
model formats), `formats` (choosing one), `spec` (checking the request's tools), `prompt`
(rendering), `plan` (one request's tool mode and guide), `reply` (the answer's pieces).
"""
