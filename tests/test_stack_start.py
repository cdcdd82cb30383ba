"""`ops.stack.up` when a service dies while it starts: a signal from outside gets one more start, an exit
of its own stops `up` with the exit status and the log; `down` stops in waves by what waits for what.
Real processes (small HTTP servers), no stubs."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flows.settings import PipelineSettings
from ops import stack
from ops.service import Service
from ops.stack import StackError

SERVICE = """
import http.server, os, signal, sys
marker, port, exit_code = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if not os.path.exists(marker):
    open(marker, "w").close()
    print("first start", flush=True)
    if exit_code < 0:
        os.kill(os.getpid(), -exit_code)
    sys.exit(exit_code)
http.server.ThreadingHTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _one_service(monkeypatch, tmp_path: Path, first_exit: int) -> tuple[PipelineSettings, Path]:
    script = tmp_path / "flaky.py"
    script.write_text(textwrap.dedent(SERVICE))
    port = _free_port()
    spec = Service("flaky", [sys.executable, str(script), str(tmp_path / "started-once"), str(port), str(first_exit)],
                   url=f"http://127.0.0.1:{port}", health_url=f"http://127.0.0.1:{port}/",
                   ports=(port,), start_timeout_s=30.0, cwd=tmp_path)
    monkeypatch.setattr(stack, "service_specs", lambda settings: {"flaky": spec})
    monkeypatch.setattr(stack, "_single_specs", lambda settings: {"flaky": spec})
    settings = PipelineSettings(home=tmp_path / "home")
    return settings, settings.stack_dir


def test_a_service_killed_by_a_signal_while_starting_is_started_once_more(monkeypatch, tmp_path):
    settings, stack_dir = _one_service(monkeypatch, tmp_path, -int(signal.SIGKILL))
    try:
        result = stack.up(settings, ["flaky"])
        assert result["started"] == ["flaky"] and result["restarted"] == ["flaky"]
        assert result["services"]["flaky"]["healthy"] is True
        log = (stack_dir / "flaky.log").read_text()
        assert f"was killed by signal {int(signal.SIGKILL)} while starting; starting it once more" in log
    finally:
        stack.down(settings, ["flaky"])


def test_a_service_that_exits_by_itself_while_starting_stops_up_with_its_status_and_log(monkeypatch, tmp_path):
    settings, _ = _one_service(monkeypatch, tmp_path, 3)
    with pytest.raises(StackError, match=r"flaky exited with status 3 while starting; last log lines:\n(.|\n)*first start"):
        stack.up(settings, ["flaky"])


def test_a_pid_file_names_one_process_and_never_a_later_one_that_reuses_its_number(tmp_path):
    from leap_io.pidfiles import pid_file, pid_line, runs_program, service_pid, start_ticks

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "flaky"])
    try:
        # Popen returns once exec has begun; the kernel fills /proc/<pid>/cmdline a moment later (a window
        # a loaded machine can hit), and a service's pid file is only ever read long after that.
        deadline = time.monotonic() + 10
        while not runs_program(sleeper.pid, "flaky") and time.monotonic() < deadline:
            time.sleep(0.01)
        path = pid_file(tmp_path, "flaky")
        path.write_text(pid_line(sleeper.pid))
        assert service_pid(tmp_path, "flaky") == sleeper.pid and len(path.read_text().split()) == 2
        path.write_text(f"{sleeper.pid} {start_ticks(sleeper.pid) + 1}\n")  # the number, another start
        assert service_pid(tmp_path, "flaky") is None
        path.write_text(f"{sleeper.pid}\n")  # a file from before start times: the program still decides
        assert service_pid(tmp_path, "flaky") == sleeper.pid
        path.write_text(pid_line(sleeper.pid))
        assert service_pid(tmp_path, "other") is None  # no such file
    finally:
        sleeper.kill()
        sleeper.wait(10)
    assert service_pid(tmp_path, "flaky") is None


SLOW_TO_STOP = """
import http.server, json, signal, sys, threading, time
name, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def note(event):
    with open(log, "a") as out:
        out.write(json.dumps({"name": name, "event": event, "t": time.time()}) + "\\n")

def stop(signum, frame):
    note("term")
    time.sleep(1.5)  # a server finishing its requests
    note("exit")
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
server = http.server.ThreadingHTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()
while True:
    time.sleep(0.1)
"""


def test_down_stops_what_waits_first_and_each_wave_at_once(monkeypatch, tmp_path):
    script, log = tmp_path / "slow.py", tmp_path / "events.jsonl"
    script.write_text(textwrap.dedent(SLOW_TO_STOP))
    specs = {}
    for name, after in (("store", ()), ("api", ("store",)), ("jobs", ("store",))):
        port = _free_port()
        specs[name] = Service(name, [sys.executable, str(script), name, str(port), str(log)],
                              url=f"http://127.0.0.1:{port}", health_url=f"http://127.0.0.1:{port}/",
                              ports=(port,), start_timeout_s=30.0, after=after, cwd=tmp_path)
    monkeypatch.setattr(stack, "service_specs", lambda settings: specs)
    monkeypatch.setattr(stack, "_single_specs", lambda settings: specs)
    settings = PipelineSettings(home=tmp_path / "home")
    assert stack.stop_waves(list(specs), specs) == [["jobs", "api"], ["store"]]
    try:
        stack.up(settings)
        result = stack.down(settings, grace_s=10.0)
    finally:
        stack.down(settings, grace_s=2.0)  # stops nothing after a pass; what did start, after a failure
    assert result["stopped"] == {"jobs": "terminated", "api": "terminated", "store": "terminated"}
    events = [json.loads(line) for line in log.read_text().splitlines()]
    at = {(e["name"], e["event"]): e["t"] for e in events}
    assert len(at) == 6
    # the two that wait for the store were stopping at once, and the store was asked only once both had gone
    assert max(at["api", "term"], at["jobs", "term"]) < min(at["api", "exit"], at["jobs", "exit"])
    assert at["store", "term"] > max(at["api", "exit"], at["jobs", "exit"])


def test_the_fleet_stops_replicas_and_workers_then_the_servers_then_their_stores(tmp_path):
    from ops.stack_fleet import fleet_specs, plan_layout

    settings = PipelineSettings(home=tmp_path / "home")
    specs = fleet_specs(settings, plan_layout(settings, 2))
    waves = stack.stop_waves(list(specs), specs)
    assert [sorted(wave) for wave in waves] == [
        sorted(name for name in specs if name.startswith(("serving", "worker"))), ["mlflow", "prefect"],
        ["postgres", "s3"]]
    single = stack._single_specs(settings)  # nothing waits for another: one wave, last started first
    assert stack.stop_waves(list(single), single) == [list(reversed(single))]
