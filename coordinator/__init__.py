"""The control plane (DESIGN §1–§4): etcd store and election, node registry, KV event
subscribers, the global prefix index, the routing policy and the `/route` service.

Map: store.py/etcd_store.py (etcd), etcd_server.py (a real etcd and its command line, for
tests and `duet up`), cluster_view.py (the one reader of nodes and replicas in etcd: gateway,
`duet status`, drain, registry), registry.py (nodes in etcd, watched), lease.py (the one
lease-keeping loop: election and node registration), subscriber.py (a node's KV events → index +
load), index.py, nodes.py (per-node view, pending decisions), policy.py (routing), election.py,
service.py (one replica's state), app.py/server.py (HTTP), drain.py, client.py (RouteClient, the
one client of /route, for gateways and tools).
"""
