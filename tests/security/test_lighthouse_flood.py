"""Issue 60, finding 2: idle connections against the head's Lighthouse under systemd's
default open-file limit. 400 connections that send only the HTTP/2 preface, to a real
Lighthouse behind its filter in a process limited to 1,024 descriptors (soft and hard, so
the head's own raise cannot help): before, the filter opened a connection to torchft's
listener for each, the process ran out of descriptors, torchft's listener ended for good
and no replica could join. Now: the process stays below its limit, the status page
answers and torchft's own client gets its quorum during the flood and after it, and
torchft's listener, ended by hand, is started again in its place behind the same address."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import urllib.request
from datetime import timedelta

import pytest

from tests.conftest import REPO, wait_until

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FLOOD = 400
LIMIT = 1024

# the head's Lighthouse in a process of its own, at 1,024 open files
HEAD = f"""
import json, resource, sys, threading
resource.setrlimit(resource.RLIMIT_NOFILE, ({LIMIT}, {LIMIT}))
from spotctl.head.lighthouse import Lighthouse
lh = Lighthouse("127.0.0.1")
print(json.dumps({{"port": lh.port, "inner": lh.inner_port}}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "kill-inner":
        lh._server.shutdown()
    print(json.dumps({{"inner": lh.inner_port, "restarts": lh.restarts,
                      "conns": lh._filter.connections}}), flush=True)
lh.stop()
"""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _quorum(address: str, step: int) -> int:
    from torchft.coordination import LighthouseClient

    client = LighthouseClient(address, connect_timeout=timedelta(seconds=10))
    client.heartbeat("fresh")
    q = client.quorum("fresh", timeout=timedelta(seconds=20), address="http://127.0.0.1:9",
                      store_address="127.0.0.1:9", step=step, world_size=1)
    return len(q.participants)


def _status(address: str) -> bytes:
    with urllib.request.urlopen(f"{address}/status", timeout=10) as r:
        return r.read()


def test_idle_preface_flood_under_1024_descriptors(tmp_path: object) -> None:
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=dict(os.environ, RUST_LOG="warn"))
    assert head.stdout is not None and head.stdin is not None
    lines: list[str] = []

    def ask(cmd: str = "info") -> dict[str, int]:
        assert head.stdin is not None and head.stdout is not None
        head.stdin.write(cmd + "\n")
        head.stdin.flush()
        while True:
            line = head.stdout.readline()
            lines.append(line)
            if line.startswith("{"):
                return json.loads(line)
            assert line, "the head process ended:\n" + "".join(lines)

    flood: list[socket.socket] = []
    try:
        while not (line := head.stdout.readline()).startswith("{"):
            lines.append(line)
            assert line, "the head process ended:\n" + "".join(lines)
        ports = json.loads(line)
        address = f"http://127.0.0.1:{ports['port']}"
        assert _quorum(address, 1) == 1
        for _ in range(FLOOD):
            s = socket.create_connection(("127.0.0.1", ports["port"]), timeout=10)
            s.sendall(PREFACE)
            flood.append(s)
        # during the flood: the head below its limit, its status page and a quorum served,
        # torchft's listener the same
        used = _fds(head.pid)
        assert used < LIMIT - 64, f"{used} descriptors open in the head"
        assert b"Current quorum_id" in _status(address)
        assert _quorum(address, 2) == 1
        info = ask()
        assert info["inner"] == ports["inner"] and info["restarts"] == 0, info
        socket.create_connection(("127.0.0.1", ports["inner"]), timeout=10).close()
        # after it
        for s in flood:
            s.close()
        flood.clear()
        wait_until(lambda: ask()["conns"] <= 1, 30, "the flood's connections closed")
        assert b"Current quorum_id" in _status(address)
        assert _quorum(address, 3) == 1
        # torchft's listener ended (as it did at the limit): a new one behind the same address
        ask("kill-inner")
        wait_until(lambda: ask()["restarts"] >= 1, 30, "a new torchft listener")
        assert _quorum(address, 4) == 1
        assert b"Current quorum_id" in _status(address)
    finally:
        for s in flood:
            s.close()
        head.stdin.close()
        try:
            head.wait(20)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
