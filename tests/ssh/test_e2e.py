"""End to end through the real CLI: `up --provider ssh` with two loopback hosts (two real
sshd), the training job (torchrun + gloo) reaching a few steps, `ssh` and `logs` on a node,
then `down` releasing both hosts."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CliProject, SshdFactory

pytestmark = [pytest.mark.ssh, pytest.mark.e2e, pytest.mark.slow]  # real torchrun over sshd

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


class ByoProject(CliProject):
    remote: Path

    def debug(self) -> str:
        r = self.remote
        return "\n".join(
            f"--- {p.relative_to(r)}\n{p.read_text(errors='replace')[-1500:]}"
            for p in sorted(r.glob("byo/*/*.log")) + sorted(r.glob("byo/*/work/*.log"))
        )


def test_up_train_ssh_logs_down(sshd_factory: SshdFactory, client_key: Path, tmp_path: Path):
    a, b = sshd_factory.start(), sshd_factory.start()
    remote = tmp_path / "remote"
    proj = ByoProject(tmp_path, "byo", {"SPOTCTL_SSH_REMOTE_ROOT": str(remote)})
    proj.remote = remote
    (proj.project / "spotctl.toml").write_text(
        'name = "byo"\nprovider = "ssh"\ngpus = "2"\n\n'
        f'[train]\nengine = "torchrun"\nscript = "train.py"\ncheckpoint_every = 5\n'
        f'python = "{sys.executable}"\n'
        'env = { TRAIN_STEP_SLEEP_S = "0.05" }\n\n'
        '[ssh]\ndedicated_hosts = true\n\n'
        + "".join(
            f'[[ssh.hosts]]\naddress = "127.0.0.1"\nport = {s.port}\nkey = "{client_key}"\n\n'
            for s in (a, b)
        )
    )
    cli = proj.cli

    nodes = [f"ssh-127-0-0-1-{a.port}", f"ssh-127-0-0-1-{b.port}"]
    try:
        cli("up", "--wait", "180", timeout=400)
        proj.wait_for("world 2 past step 10",
                      lambda st: st.get("world_size") == 2 and (st.get("step") or 0) >= 10,
                      timeout=180, interval=1)  # fmt: skip

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
