"""The OpenAI-compatible public gateway (DESIGN §1 steps 1-5): keys and teams, quotas with
reserve-then-settle in the store, tiers, routing to prefill/decode nodes (coordinator, static
lists or etcd), usage records. Never imports torch or engine/.

Map: app (HTTP, lifecycle) → serve (one request, end to end) → requests/responses (bodies) ·
auth, keys, admin · store/ (SQLite, Postgres; quota rules) · usage_writer · tiers ·
backend (the model seam) → cluster (P/D legs) → node_client · routing, etcd_view · config.
"""
