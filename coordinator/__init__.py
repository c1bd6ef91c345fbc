"""The control plane (DESIGN §1–§4): etcd store and election, node registry, KV event
subscribers, the global prefix index, the routing policy and the `/route` service.

Map: store.py/etcd_store.py (etcd), etcd_server.py (a real etcd for tests and `duet up`),
registry.py (nodes in etcd), subscriber.py (a node's KV events → index + load), index.py,
nodes.py (per-node view, pending decisions), policy.py (routing), election.py, service.py
(one replica's state), app.py/server.py (HTTP), drain.py, client.py (RouteClient for gateways).
"""
