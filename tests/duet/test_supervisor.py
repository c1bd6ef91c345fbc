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

    policy = RestartPolicy(max_restarts=2, backoff_s=0.5, backoff_max_s=5.0, stable_s=60.0,
                         startup_timeout_s=2.0, liveness_timeout_s=3.0)
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

    sup = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(tmp_path), str(web_port), str(flaky_port)],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: (
                child("web").get("state") == "running" and child("flaky").get("state") == "running"
            ),
            60,
            "both children up",
        )
        web_pid, first = child("web")["pid"], child("flaky")["pid"]
        os.kill(first, signal.SIGKILL)
        # Restarted after 0.5 s, then 1 s: each later life hangs and is killed at the 2 s timeout.
        gone = wait_for(
            lambda: child("flaky").get("state") == "failed" and child("flaky"),
            60,
            "flaky left down",
        )
        assert (
            gone["restarts"] == 2
            and gone["failures_in_a_row"] == 3
            and gone["last_exit"] == -signal.SIGKILL
        )
        assert gone["last_cause"] == "not healthy 2 s after its start"
        assert child("web")["pid"] == web_pid and child("web")["restarts"] == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/", timeout=5) as r:
            assert r.status == 200  # the sibling serves on
        assert not alive(gone["pid"]) and not group_alive(
            gone["pid"]
        )  # the hung life was killed, group and all
        # A running child that hangs (SIGSTOP) is killed once it has not answered for 3 s, and
        # restarted.
        os.kill(web_pid, signal.SIGSTOP)
        back = wait_for(
            lambda: (c := child("web")).get("state") == "running" and c["restarts"] == 1 and c,
            60,
            "the hung web child restarted",
        )
        assert (
            back["last_cause"] == "not answering its health check for 3 s"
            and back["pid"] != web_pid
        )
        assert not alive(web_pid)
        web_pid = back["pid"]
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/", timeout=5) as r:
            assert r.status == 200
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == 0
        err = sup.stderr.read()
        assert "flaky killed by SIGKILL after" in err and "restarting it in 0.5 s" in err, err
        assert (
            "restarting it in 1.0 s" in err and "leaving it down (the rest keep serving)" in err
        ), err
        assert (
            not alive(web_pid)
            and child("web")["state"] == "stopped"
            and child("flaky")["state"] == "failed"
        )
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait(10)


FIRST_START = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from duet.supervisor import Child, RestartPolicy, Supervisor

    tmp, mode, base_port, web_port, late_port = Path(sys.argv[1]), sys.argv[2], *sys.argv[3:]
    server = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]
    if mode == "late":  # stage 0 starts; in stage 1, `late` fails every start until a file appears
        base = Child("base", [*server, base_port], tmp / "base.log", f"http://127.0.0.1:{base_port}/")
    else:  # stage 0 can never start: the stages after it are never started
        base = Child("base", ["bash", "-c", f"echo cannot listen on port {base_port}; exit 4"],
                     tmp / "base.log", f"http://127.0.0.1:{base_port}/")
    web = Child("web", [*server, web_port], tmp / "web.log", f"http://127.0.0.1:{web_port}/")
    late = Child("late", ["bash", "-c", f"[ -e {tmp}/ready ] || {{ echo no secret yet; exit 3; }}; "
                          f"exec {' '.join(server)} {late_port}"], tmp / "late.log", f"http://127.0.0.1:{late_port}/")

    def changed(sup):
        out = tmp / "status.json"
        out.with_suffix(".tmp").write_text(json.dumps([c.status() for c in sup.children]))
        out.with_suffix(".tmp").replace(out)

    policy = RestartPolicy(max_restarts=2 if mode == "never" else 1000, backoff_s=0.2,
                           backoff_max_s=0.5, startup_timeout_s=30.0)
    sys.exit(Supervisor([[base], [web, late]], tail=False, on_change=changed, restart=policy).run())
""")


def _first_start(tmp: Path, mode: str) -> tuple[subprocess.Popen[str], list[int]]:
    ports = [free_port() for _ in range(3)]
    return subprocess.Popen(
        [sys.executable, "-c", FIRST_START, str(tmp), mode, *map(str, ports)],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ), ports


def test_a_child_whose_first_start_fails_is_restarted_while_the_rest_serve(tmp_path: Path) -> None:
    status = tmp_path / "status.json"

    def child(name: str) -> dict:
        try:
            return next(c for c in json.loads(status.read_text()) if c["name"] == name)
        except (FileNotFoundError, ValueError, StopIteration):
            return {}

    sup, (_, web_port, late_port) = _first_start(tmp_path, "late")
    try:
        # The stage is through once `web` is up and `late` has failed once: `web` serves while
        # `late` is restarted with the backoff, each failure counted, as after any crash.
        wait_for(lambda: child("web").get("state") == "running", 60, "web up")
        failing = wait_for(
            lambda: (c := child("late")).get("restarts", 0) >= 2 and c, 60, "late restarted twice"
        )
        assert failing["failures_in_a_row"] >= 2 and failing["last_exit"] == 3, failing
        assert failing["last_cause"].startswith("exited with code 3 after"), failing
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/", timeout=5) as r:
            assert r.status == 200
        assert sup.poll() is None
        (tmp_path / "ready").touch()  # what it lacked arrives: its next start works
        up = wait_for(lambda: (c := child("late")).get("state") == "running" and c, 60, "late up")
        assert up["restarts"] >= 2 and child("web")["restarts"] == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{late_port}/", timeout=5) as r:
            assert r.status == 200
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == 0
        err = sup.stderr.read()
        assert "late exited with code 3 after" in err and "restarting it in 0.2 s" in err, err
        assert "could not start" not in err, err
        assert not alive(up["pid"]) and child("late")["state"] == "stopped"
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait(10)


def test_a_stage_that_can_never_start_stops_everything_naming_it_and_its_log(
    tmp_path: Path,
) -> None:
    sup, (base_port, _, _) = _first_start(tmp_path, "never")
    try:
        # base fails 3 times (2 restarts, 0.2 s then 0.4 s apart), then the start-up ends with an
        # error
        assert sup.wait(60) == 1
        err = sup.stderr.read()
        assert "base could not start (over the limit of failures in a row)" in err, err
        assert "base: 3 failure(s) in a row, last: exited with code 4 after" in err, err
        assert f"base | cannot listen on port {base_port}" in err, err  # its log's last lines
        assert "starting web" not in err and "starting late" not in err, (
            err
        )  # nothing after it started
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait(10)
