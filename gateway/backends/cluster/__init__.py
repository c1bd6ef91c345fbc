"""duet's own prefill/decode nodes as a backend."""
