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
