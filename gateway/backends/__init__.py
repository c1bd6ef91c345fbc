"""Whoever generates tokens or embeddings behind the gateway's seams."""
