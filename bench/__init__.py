"""Benchmarks and load tools for SREs; each module runs with `python -m bench.<name>`."""
