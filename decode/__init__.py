"""The decode node role: pull KV blocks, decode with continuous batching, stream tokens."""
