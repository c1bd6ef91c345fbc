"""API keys: `sk-duet-` + 32 random bytes (url-safe base64), shown once, stored as a hash.

The secret has 256 bits of entropy, so a plain SHA-256 is a safe digest to store and look
up by (no slow KDF needed: there is nothing to brute-force). Key ids (`key_…`) are public.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
import uuid

from gateway.accounts.store.base import ApiKey

PREFIX = "sk-duet-"


def new_secret() -> str:
    return PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def same_secret(secret: str, expected_sha256: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), expected_sha256)


def new_key(team_id: str, name: str = "") -> tuple[ApiKey, str, str]:
    """(key row, the secret to show once, its hash to store)."""
    secret = new_secret()
    key = ApiKey(
        id=f"key_{uuid.uuid4().hex[:16]}",
        team_id=team_id,
        name=name,
        prefix=secret[: len(PREFIX) + 4],
        created_at=time.time(),
    )
    return key, secret, hash_secret(secret)
