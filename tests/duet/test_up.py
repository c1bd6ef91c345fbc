"""`duet up` starts a working system on one machine and stops it cleanly."""

import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

from tests.procs import Proc, free_port


def test_up_serves_completions_and_stops_cleanly(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    up = Proc([sys.executable, "-m", "duet", "up", "--model", str(tiny_llama), "--port", str(port),
               "--threads", "1", "--kv-memory", "64MiB"], port, tmp_path / "up.log")  # fmt: skip
    try:
        up.wait_healthy(120)
        deadline = time.monotonic() + 60
        while "all up" not in up.log():  # the supervisor reports after its own health check
            assert time.monotonic() < deadline, up.log()
            time.sleep(0.05)
        req = urllib.request.Request(
            up.url + "/v1/completions",
            data=json.dumps({"prompt": "Paris is the capital", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        body = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
    finally:
        up.kill()
    assert "stopped" in up.log()
