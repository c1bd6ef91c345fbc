"""The `duet` command line and the one-machine cluster supervisor (`duet up`).

The composition root: the only package that may import every other one; nothing imports it.
"""
