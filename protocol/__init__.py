"""Wire contracts shared by every duet process.

This package is the one place where the gateway, the coordinator, the nodes and bench agree
on bytes: block hashing, KV layouts, request/response structs and the tokenizer wrapper.

Invariant: importing anything here never imports torch (the gateway and bench run without
it; `tests/protocol/test_no_torch.py` checks `sys.modules`).
"""
