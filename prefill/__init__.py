"""The prefill node role: prompts → KV blocks held for decode nodes."""
