"""etcd-backed coordinator: node registry, prefix index, routing (later issue)."""
