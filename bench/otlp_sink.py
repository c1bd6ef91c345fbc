"""`python -m bench.otlp_sink --port N`: an OTLP/HTTP trace receiver for benches.

It stands where Jaeger, Tempo or an OpenTelemetry Collector would: `POST /v1/traces` takes the
SDK's protobuf export (gzip or not), decodes it with opentelemetry-proto — so a malformed body is
a 400, as a collector would answer — and counts the spans. `GET /count` answers
`{"spans": n, "exports": m, "bytes": b}`, which a bench polls to know every span arrived.

It runs as its own process so that decoding costs the bench's CPU figures nothing: the gateway
whose exporter talks to it pays only for building, serialising and sending its spans.
"""

from __future__ import annotations

import argparse
import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec


class Count(msgspec.Struct, frozen=True):
    """What the sink has received so far."""

    spans: int
    exports: int
    bytes: int


class _Sink:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans = self.exports = self.bytes = 0

    def add(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        req = ExportTraceServiceRequest()
        req.ParseFromString(body)  # raises on a body that is not an export request
        n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        with self.lock:
            self.spans += n
            self.exports += 1
            self.bytes += len(body)

    def count(self) -> Count:
        with self.lock:
            return Count(self.spans, self.exports, self.bytes)


def serve(port: int) -> None:
    sink = _Sink()

    class Handler(BaseHTTPRequestHandler):
        def _answer(
            self, status: int, body: bytes = b"", ctype: str = "application/x-protobuf"
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            if self.path != "/v1/traces":
                return self._answer(404)
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                sink.add(body)
            except Exception:  # not OTLP: refuse it as a collector would
                return self._answer(400)
            self._answer(200)

        def do_GET(self) -> None:
            if self.path == "/health":
                return self._answer(200, b"ok", "text/plain")
            if self.path != "/count":
                return self._answer(404)
            self._answer(200, msgspec.json.encode(sink.count()), "application/json")

        def log_message(
            self, *args: object
        ) -> None:  # one line per export would drown the bench's log
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.otlp_sink",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--port", type=int, required=True, help="port on 127.0.0.1")
    serve(p.parse_args(argv).port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
