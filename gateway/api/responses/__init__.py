"""OpenAI's Responses API, served by translation onto the chat path."""
