"""Runtime shared by every node role: HTTP API, engine seam, metrics, shutdown."""
