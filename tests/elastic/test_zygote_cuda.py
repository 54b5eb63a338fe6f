"""The warm-start zygote refuses to fork once CUDA is initialised in it (a forked child
cannot use its parent's CUDA context): the launcher then starts the worker cold. CUDA
cannot be initialised on a CPU machine, so the zygote here is told that it is (torch's
own query replaced), and everything else runs for real."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)
PY = sys.executable


def test_zygote_with_cuda_initialised_refuses_and_launcher_runs_cold(tmp_path):
    sock = tmp_path / "z.sock"
    boot = ("import sys, torch\ntorch.cuda.is_initialized = lambda: True\n"
            "from spotctl.agent import zygote\nzygote.serve(sys.argv[1])\n")
    z = subprocess.Popen([PY, "-c", boot, str(sock)])
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert time.monotonic() < deadline and z.poll() is None, "zygote did not start"
            time.sleep(0.1)
        script = tmp_path / "s.py"
        script.write_text("import sys, os\nprint('torch' in sys.modules, os.getppid())\n")
        env = dict(os.environ, SPOTCTL_ZYGOTE=str(sock))
        p = subprocess.run([PY, "-m", "spotctl.agent.launch", str(script)], env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        warm, parent = p.stdout.split()
        # cold: a fresh interpreter (no torch preloaded), not a child of the zygote
        assert warm == "False" and int(parent) != z.pid
    finally:
        z.kill()
        z.wait()


# In the zygote every CUDA query fails loudly (the zygote crashes on it); in the processes
# it forks, the real one runs and is counted in a file.
_STRICT_BOOT = """
import os, sys, torch
ZYGOTE = os.getpid()

def guard(name, real):
    def q(*a, **kw):
        if os.getpid() == ZYGOTE:
            raise SystemExit(f"CUDA queried in the zygote: torch.cuda.{name}")
        with open(os.environ["CUDA_QUERIES"], "a") as f:
            f.write(name + "\\n")
        return real(*a, **kw)
    return q

for name in ("is_available", "device_count", "_lazy_init", "init", "current_device",
             "get_device_properties", "mem_get_info"):
    setattr(torch.cuda, name, guard(name, getattr(torch.cuda, name)))
from spotctl.agent import zygote
zygote.serve(sys.argv[1])
"""

_WORKER = """
import os, sys
warm = "spotctl.elastic" in sys.modules
from spotctl import elastic
dev = elastic.init()
print(warm, os.getppid(), dev.type)
"""


def test_zygote_asks_no_cuda_question_and_its_workers_do(tmp_path):
    """Importing spotctl.elastic in the zygote must not query CUDA (a query poisons every
    forked worker: "Cannot re-initialize CUDA in forked subprocess"); the worker it forks
    asks when it sets its device, in elastic.init()."""
    sock = tmp_path / "z.sock"
    queries = tmp_path / "queries"
    env = dict(os.environ, CUDA_QUERIES=str(queries))
    z = subprocess.Popen([PY, "-c", _STRICT_BOOT, str(sock)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if z.poll() is not None:
                pytest.fail(f"zygote exited: {z.stdout.read() if z.stdout else ''}")
            assert time.monotonic() < deadline, "zygote did not start"
            time.sleep(0.1)
        script = tmp_path / "w.py"
        script.write_text(_WORKER)
        wenv = dict(env, SPOTCTL_ZYGOTE=str(sock), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        p = subprocess.run([PY, "-m", "spotctl.agent.launch", str(script)], env=wenv,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        # the last line: torch 2.9's gloo prints a line of its own on stdout first
        warm, parent, device = p.stdout.splitlines()[-1].split()
        # forked warm by the zygote (which had imported spotctl.elastic without a query)
        assert warm == "True" and int(parent) == z.pid, p.stdout
        assert device == "cpu"
        # the worker asked, once it set up its device
        assert "is_available" in queries.read_text().split()
        assert z.poll() is None, "the zygote died"
    finally:
        z.kill()
        z.wait()
