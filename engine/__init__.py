"""The native paged-KV engine (DESIGN.md §3): pure compute, no HTTP, etcd or NIXL inside."""
