"""A NATS server started by a process that is killed (SIGKILL: no atexit, no cleanup) stops with it: the server's
process asks the kernel for SIGTERM when its parent dies (``events.server``'s start shim, Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTER = """
import sys, time
from pathlib import Path
from deepinfer.events.server import NatsServer
d = Path(sys.argv[1])
s = NatsServer(store_dir=d / "store", log_file=d / "nats.log").start()
print("PID", s.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(120)
def test_the_server_stops_when_its_starter_is_killed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "libs")}
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = ""
        while not line.startswith("PID "):  # (the start logs to stdout too)
            line = starter.stdout.readline()
            assert line, "the starter ended without starting a server"
        pid = int(line.split()[1])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"nats-server" in cmdline  # the shim became the server: same pid
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            try:  # reaped by init once it exits; a zombie still shows its stat as Z
                if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
                    break
            except OSError:
                break
            time.sleep(0.05)
        alive = Path(f"/proc/{pid}").exists() and not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[
            1
        ].startswith("Z")
        if alive:
            os.kill(pid, signal.SIGKILL)
        assert not alive, "the NATS server outlived the process that started it"
    finally:
        if starter.poll() is None:
            starter.kill()
