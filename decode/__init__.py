"""The decode node role: pull KV blocks from prefill nodes, decode with continuous batching, stream."""
