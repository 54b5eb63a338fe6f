"""Warm worker starts: the launcher hands its script to the node's zygote, which forks it
with torch already imported; exit codes, signals, stdio and launcher death behave as if
the script ran in the launcher itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotctl.agent import proctree

pytestmark = pytest.mark.timeout(120)
PY = sys.executable


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    d = tmp_path_factory.mktemp("zy")
    sock = d / "z.sock"
    p = subprocess.Popen([PY, "-m", "spotctl.agent.zygote", str(sock)])
    deadline = time.monotonic() + 60
    while not sock.exists():
        assert time.monotonic() < deadline and p.poll() is None, "zygote did not start"
        time.sleep(0.1)
    yield str(sock)
    p.kill()
    p.wait()


def _script(tmp_path: Path, body: str) -> Path:
    f = tmp_path / "s.py"
    f.write_text("import os, sys, time, signal\n" + body)
    return f


def _launch(script: Path, sock: str, *args: str, **kw):
    env = dict(os.environ, SPOTCTL_ZYGOTE=sock, MARK="from-launcher")
    return subprocess.Popen([PY, "-m", "spotctl.agent.launch", str(script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_forked_worker_gets_argv_env_cwd_stdio_and_exit_code(tmp_path, zygote):
    s = _script(tmp_path, "import torch\nprint(sys.argv[1:], os.environ['MARK'], os.getcwd(),"
                          " 'torch' in sys.modules, os.getppid() != int(sys.argv[1]))\n"
                          "print('err', file=sys.stderr)\nsys.exit(3)\n")
    p = _launch(s, zygote, str(os.getpid()), cwd=tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3
    assert out.strip() == f"[{str(os.getpid())!r}] from-launcher {tmp_path} True True"
    assert "err" in err


def test_signals_are_forwarded_and_reported(tmp_path, zygote):
    s = _script(tmp_path, "print(os.getpid(), flush=True)\ntime.sleep(60)\n")
    p = _launch(s, zygote)
    child = int(p.stdout.readline())
    assert child != p.pid and proctree.alive(child)
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    assert p.returncode == -signal.SIGTERM  # the launcher dies of the child's signal
    assert not proctree.alive(child)


def test_child_dies_with_its_launcher(tmp_path, zygote):
    s = _script(tmp_path, "print(os.getpid(), flush=True)\ntime.sleep(60)\n")
    p = _launch(s, zygote)
    child = int(p.stdout.readline())
    p.kill()
    p.wait(10)
    deadline = time.monotonic() + 10
    while proctree.alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not proctree.alive(child)


def test_without_a_zygote_the_script_runs_cold(tmp_path):
    s = _script(tmp_path, "print('cold', 'torch' in sys.modules)\nsys.exit(4)\n")
    p = _launch(s, str(tmp_path / "no.sock"))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 4 and out.strip() == "cold False"
