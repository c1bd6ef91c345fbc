"""The gateway's public HTTP APIs, one module (or package) per API."""
