"""The restart policy of duet/supervisor.py on plain processes (small HTTP servers; seconds,
not a cluster): a killed child comes back on its port after the backoff while its sibling
keeps its pid; a restarted child that never gets healthy is killed at the start-up timeout,
which counts as a failure, and after the limit it stays down while the sibling serves; the
delays double; SIGTERM stops everything and leaves nothing behind.

The supervisor runs in its own process (it installs signal handlers, so it needs a main
thread); it writes every child's status to a JSON file on each change, as `duet up` does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

from tests.duet.test_up import alive, group_alive
from tests.procs import free_port
from tests.wait import wait_for

RUNNER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from duet.supervisor import Child, RestartPolicy, Supervisor

    tmp, web_port, flaky_port = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    server = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]
    web = Child("web", [*server, web_port], tmp / "web.log", f"http://127.0.0.1:{web_port}/")
    # First life: a server. Every later life: alive but never healthy (a hung start-up).
    flaky = Child("flaky", ["bash", "-c", f"if [ -e {tmp}/started ]; then exec sleep 1000; fi; "
                            f"touch {tmp}/started; exec {' '.join(server)} {flaky_port}"],
                  tmp / "flaky.log", f"http://127.0.0.1:{flaky_port}/")

    def changed(sup):
        out = tmp / "status.json"
        out.with_suffix(".tmp").write_text(json.dumps([c.status() for c in sup.children]))
        out.with_suffix(".tmp").replace(out)

    policy = RestartPolicy(max_restarts=2, backoff_s=0.5, backoff_max_s=5.0, stable_s=60.0, startup_timeout_s=2.0,
                         liveness_timeout_s=3.0)
    sys.exit(Supervisor([[web, flaky]], tail=False, on_change=changed, restart=policy).run())
""")


def test_backoff_startup_timeout_and_crash_loop_on_plain_processes(tmp_path: Path) -> None:
    web_port, flaky_port = free_port(), free_port()
    status = tmp_path / "status.json"

    def child(name: str) -> dict:
        try:
            return next(c for c in json.loads(status.read_text()) if c["name"] == name)
        except (FileNotFoundError, ValueError):
            return {}

    sup = subprocess.Popen([sys.executable, "-c", RUNNER, str(tmp_path), str(web_port), str(flaky_port)],
                           stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: child("web").get("state") == "running" and child("flaky").get("state") == "running", 60,
                 "both children up")  # fmt: skip
        web_pid, first = child("web")["pid"], child("flaky")["pid"]
        os.kill(first, signal.SIGKILL)
        # Restarted after 0.5 s, then 1 s: each later life hangs and is killed at the 2 s timeout.
        gone = wait_for(lambda: child("flaky").get("state") == "failed" and child("flaky"), 60, "flaky left down")
        assert gone["restarts"] == 2 and gone["failures_in_a_row"] == 3 and gone["last_exit"] == -signal.SIGKILL
        assert gone["last_cause"] == "not healthy 2 s after its start"
        assert child("web")["pid"] == web_pid and child("web")["restarts"] == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/", timeout=5) as r:
            assert r.status == 200  # the sibling serves on
        assert not alive(gone["pid"]) and not group_alive(gone["pid"])  # the hung life was killed, group and all
        # A running child that hangs (SIGSTOP) is killed once it has not answered for 3 s, and restarted.
        os.kill(web_pid, signal.SIGSTOP)
        back = wait_for(lambda: (c := child("web")).get("state") == "running" and c["restarts"] == 1 and c, 60,
                        "the hung web child restarted")  # fmt: skip
        assert back["last_cause"] == "not answering its health check for 3 s" and back["pid"] != web_pid
        assert not alive(web_pid)
        web_pid = back["pid"]
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/", timeout=5) as r:
            assert r.status == 200
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == 0
        err = sup.stderr.read()
        assert "flaky killed by SIGKILL after" in err and "restarting it in 0.5 s" in err, err
        assert "restarting it in 1.0 s" in err and "leaving it down (the rest keep serving)" in err, err
        assert not alive(web_pid) and child("web")["state"] == "stopped" and child("flaky")["state"] == "failed"
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait(10)
