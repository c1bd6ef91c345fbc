"""The nodes' SSE stream cut into `data:` payloads as network reads arrive (no read per line).

Nodes send only `data: <json>\n\n` events and a final `data: [DONE]`; `DataLines.feed(read)`
returns the payloads of the lines that read completed, in order, and keeps the unfinished
tail for the next read. Everything that arrived in one read comes back in one list, which is
how the relay knows a chunk's successor is already here (`more`). A line that grows past
`max_line` bytes without ending is refused (ValueError): a broken node cannot grow the
gateway's memory without bound. (Providers' full SSE — `event:` fields, comments, first-byte
deadlines — is gateway/providers/sse.py.)
"""

from __future__ import annotations

#: a node's SSE line longer than this is a broken stream
MAX_LINE = 16 * 2**20


class DataLines:
    def __init__(self, max_line: int | None = None) -> None:
        self.max_line = MAX_LINE if max_line is None else max_line
        self._rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        lines = (self._rest + data).split(b"\n") if self._rest else data.split(b"\n")
        self._rest = lines.pop()
        if len(self._rest) > self.max_line:
            raise ValueError(f"an SSE line over {self.max_line} bytes")
        return [ln[6:].strip() for ln in lines if ln.startswith(b"data: ")]
