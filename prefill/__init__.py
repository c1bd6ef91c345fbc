"""The prefill node role: prompts → KV blocks held (under a lease) for decode nodes."""
