"""Anthropic's Messages API, served by translation onto the chat path."""
