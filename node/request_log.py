"""Request-scoped logging: every log line written while a request is handled carries its
X-Request-Id, without threading the id through every call (a contextvar + a logging filter).
"""

from __future__ import annotations

import contextvars
import logging

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("duet_request_id", default="-")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def setup_logging(level: str = "INFO", name: str = "duet") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s {name} [%(request_id)s] %(name)s: %(message)s"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
