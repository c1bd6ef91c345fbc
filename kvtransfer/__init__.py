"""Moving KV blocks between node processes: NIXL (default), UCX and TCP backends."""
