"""The server kit every duet process shares: HTTP error bodies and read deadlines, the cluster
secret and the internal plane's security, tracing, ports, strict mode (no silent fallback),
tables and throttled logs, and where models live on disk (`$DUET_HOME`).

protocol/ holds the wire contracts; this package holds the machinery around them.

Invariant: importing anything here never imports torch (the gateway and bench run without it;
`tests/runtime/test_no_torch.py` checks `sys.modules`).
"""
