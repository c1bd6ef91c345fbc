"""A store URL as logs may show it: a PostgreSQL DSN's password replaced by `***`.

Invariant: every line the gateway writes about its store (the ready line, the start-up log, a
failure to open it) goes through `redact` or `scrub`, so the password never reaches pod logs or
log aggregation. The DSN itself stays off the command line too (`$DUET_STORE_URL` or
`--store-url-file`, read by `duet gateway`).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

MASK = "***"


def _password(url: str) -> str | None:
    try:
        return urlsplit(url).password or None
    except ValueError:  # a malformed netloc (a bad port): no password we can find
        return None


def redact(url: str) -> str:
    """`url` with the password of its userinfo masked: `postgresql://u:***@host/db`."""
    password = _password(url)
    if password is None:
        return url
    parts = urlsplit(url)
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{hostport}"))


def scrub(text: str, url: str) -> str:
    """`text` (an error message that may quote the URL) with the URL's password masked."""
    password = _password(url)
    return text.replace(password, MASK) if password else text
