"""End to end through the real CLI: `up --provider ssh` with two loopback hosts (two real
sshd), the training job (torchrun + gloo) reaching a few steps, `ssh` and `logs` on a node,
then `down` releasing both hosts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO, SshdFactory

pytestmark = [pytest.mark.ssh, pytest.mark.e2e, pytest.mark.slow]  # real torchrun over sshd

SPOTCTL = [sys.executable, "-m", "spotctl.cli.app"]


def _procs_under(root: Path) -> list[int]:
    """Processes whose command line mentions the hosts' node directories (agents)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if str(root).encode() in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def test_up_train_ssh_logs_down(sshd_factory: SshdFactory, client_key: Path, tmp_path: Path):
    a, b = sshd_factory.start(), sshd_factory.start()
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "templates" / "train.py", project / "train.py")
    remote = tmp_path / "remote"
    (project / "spotctl.toml").write_text(
        'name = "byo"\nprovider = "ssh"\ngpus = "2"\n\n'
        f'[train]\nscript = "train.py"\ncheckpoint_every = 5\npython = "{sys.executable}"\n'
        'env = { TRAIN_STEP_SLEEP_S = "0.05" }\n\n'
        + "".join(
            f'[[ssh.hosts]]\naddress = "127.0.0.1"\nport = {s.port}\nkey = "{client_key}"\n\n'
            for s in (a, b)
        )
    )
    env = dict(os.environ, SPOTCTL_HOME=str(tmp_path / "home"), NO_COLOR="1",
               SPOTCTL_SSH_REMOTE_ROOT=str(remote))  # fmt: skip

    def cli(
        *args: str, check: bool = True, timeout: float = 240
    ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([*SPOTCTL, *args], cwd=project, env=env, text=True,
                           capture_output=True, timeout=timeout)  # fmt: skip
        if check and p.returncode != 0:
            raise AssertionError(f"spotctl {' '.join(args)} exited {p.returncode}:\n"
                                 f"{p.stdout}\n{p.stderr}\n{debug()}")  # fmt: skip
        return p

    def debug() -> str:
        return "\n".join(
            f"--- {p.relative_to(remote)}\n{p.read_text(errors='replace')[-1500:]}"
            for p in sorted(remote.glob("byo/*/*.log")) + sorted(remote.glob("byo/*/work/*.log"))
        )

    def status() -> dict[str, Any]:
        return dict(json.loads(cli("status", "--name", "byo", "--json").stdout))

    nodes = [f"ssh-127-0-0-1-{a.port}", f"ssh-127-0-0-1-{b.port}"]
    try:
        cli("up", "--wait", "180", timeout=400)
        deadline = time.monotonic() + 180
        st = status()
        while not (st.get("world_size") == 2 and (st.get("step") or 0) >= 10):
            assert time.monotonic() < deadline, f"no progress: {json.dumps(st)[:2000]}\n{debug()}"
            time.sleep(1)
            st = status()

        # `spotctl ssh` runs on the node with the cluster's pinned key, no prompt
        p = cli("ssh", nodes[0], "--", "cat", f"{remote}/byo/{nodes[0]}/agent.json")
        assert json.loads(p.stdout)["node_id"] == nodes[0]
        # `spotctl logs` over SSH (the agent's log: it writes unbuffered)
        p = cli("logs", nodes[1], "--name", "byo", "--log", "agent", "--lines", "20")
        assert "torchrun started" in p.stdout

        # secrets: the token is on no process's command line
        token = (tmp_path / "home" / "clusters" / "byo" / "token").read_text().strip()
        for pid in _procs_under(Path("/")):
            try:
                assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            except FileNotFoundError:
                pass
        assert _procs_under(remote), "no agent runs from the node directories"

        cli("down", "--name", "byo", "--yes", timeout=240)
        deadline = time.monotonic() + 60
        while _procs_under(remote):
            assert time.monotonic() < deadline, f"left running: {_procs_under(remote)}"
            time.sleep(0.5)
        for n in nodes:
            assert not (remote / "byo" / n / "token").exists(), "token left on a released host"
    finally:
        if (tmp_path / "home" / "state.db").exists():
            cli("down", "--name", "byo", "--yes", check=False)
        for pid in _procs_under(remote) + _procs_under(tmp_path / "home"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
