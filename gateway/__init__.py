"""OpenAI-compatible public gateway (later issue)."""
