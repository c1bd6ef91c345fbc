"""Wire contracts shared by every duet process.

This package is the one place where the gateway, the coordinator, the nodes and bench agree
on bytes: msgspec Structs and enums of every message, block hashing and KV layouts. The
machinery around them lives in runtime/ (HTTP, security, tracing) and text/ (tokenizer,
guides).

Invariant: importing anything here never imports torch (the gateway and bench run without
it; `tests/runtime/test_no_torch.py` checks `sys.modules`).
"""
