"""duet's discrete-event simulator: the real scheduler, block pool, routing policy and gateway
tier admission, run on simulated time; only a node's forward-pass step time (from a profile)
and KV transfer time (bytes over measured bandwidth) are modelled.

Modules: `profile` (the node-kind profile and its step-time model), `vclock` (an asyncio
event loop on virtual time), `node` (one node: real Scheduler + KVCacheManager + BlockPool),
`cluster` (gateway admission + coordinator policy + nodes, the life of a request),
`workload` (arrivals: distributions, bench-serve result files, Mooncake traces), `stats`
(percentiles, goodput, utilisation, cost), `run` (one simulation end to end).
"""
