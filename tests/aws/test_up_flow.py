"""`up -> status -> down` on AWS through the real CLI: moto in server mode for EC2, and a
real loopback sshd standing in for every instance (head included).

Test seam (documented in spotctl/remote/bootstrap.py and spotctl/providers/aws/provider.py):
SPOTCTL_SSH_OVERRIDE=127.0.0.1:PORT sends every instance's SSH to the sshd fixture,
SPOTCTL_SSH_OVERRIDE_KEY is the key it accepts (moto's key pair material is not a usable
key), SPOTCTL_HEAD_PORTS picks free ports for the head, and SPOTCTL_SSH_REMOTE_ROOT puts the
node directories under tmp_path. The head (`spotctl head`) and the agents (torchrun +
templates/train.py) really run, started by the bootstrap over SSH.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

# The real sshd fixtures of the ssh tests (imported, so pytest sees them here too).
from tests.ssh.conftest import REPO, Sshd, client_key, free_port, sshd, sshd_factory  # noqa: F401

from .conftest import REGION

pytestmark = [pytest.mark.aws, pytest.mark.slow, pytest.mark.timeout(900)]

SPOTCTL = [sys.executable, "-m", "spotctl.cli.app"]


def procs_mentioning(root: Path) -> list[int]:
    """Processes whose command line mentions `root` (the test's directories)."""
    out = []
    needle = str(root).encode()
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if needle in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


class Flow:
    """A project dir with spotctl.toml + train.py, and the CLI run in it with the seam."""

    def __init__(self, tmp_path: Path, server: Sshd, key: Path, spec: str, name: str):
        self.name = name
        self.tmp = tmp_path
        self.project = tmp_path / "project"
        self.project.mkdir()
        self.remote = tmp_path / "remote"
        shutil.copy(REPO / "templates" / "train.py", self.project / "train.py")
        (self.project / "spotctl.toml").write_text(spec)
        self.env = dict(
            os.environ,
            SPOTCTL_HOME=str(tmp_path / "home"),
            NO_COLOR="1",
            SPOTCTL_SSH_OVERRIDE=f"127.0.0.1:{server.port}",
            SPOTCTL_SSH_OVERRIDE_KEY=str(key),
            SPOTCTL_HEAD_PORTS=f"{free_port()}:{free_port()}",
            SPOTCTL_SSH_REMOTE_ROOT=str(self.remote),
        )

    def cli(
        self, *args: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([*SPOTCTL, *args], cwd=self.project, env=self.env, text=True,
                           capture_output=True, timeout=timeout)  # fmt: skip
        if check and p.returncode != 0:
            raise AssertionError(
                f"spotctl {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}\n"
                + self.debug()
            )
        return p

    def status(self) -> dict[str, Any]:
        return dict(json.loads(self.cli("status", "--name", self.name, "--json").stdout))

    def debug(self) -> str:
        logs = sorted(self.remote.glob("*/*/*.log")) + sorted(self.remote.glob("*/*/*/*.log"))
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-1500:]}" for p in logs)

    def leftover(self) -> list[int]:
        return procs_mentioning(self.remote) + procs_mentioning(self.tmp / "home")

    def kill_leftovers(self) -> None:
        for pid in self.leftover():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def run(self, provider: str, nodes: int, want_steps: int = 5) -> dict[str, Any]:
        """up, wait for the nodes (and a few training steps) in status, then down.
        Returns the last status seen before down."""
        p = self.cli("up", "--provider", provider, "--gpus", str(nodes), "--wait", "240",
                     "--json", timeout=600)  # fmt: skip
        up = json.loads(p.stdout)
        assert len(up["launched"]) == nodes and up["nodes_reporting"] == nodes, up
        # `up --json` phases: JSON lines on stderr, per offer, then per node
        phases = [json.loads(x) for x in p.stderr.splitlines() if x.startswith('{"phase"')]
        assert any(x["phase"] == "launching" for x in phases), p.stderr
        if provider in ("aws", "gcp"):  # their bootstrap reports each host as it finishes
            done = [x for x in phases if x["phase"] == "bootstrapped"]
            assert sorted(x["node"] for x in done) == sorted(up["launched"]), p.stderr
        deadline = time.monotonic() + 240
        st = self.status()
        while not (st.get("world_size") == nodes and (st.get("step") or 0) >= want_steps):
            assert time.monotonic() < deadline, (
                f"no progress: {json.dumps(st)[:2000]}\n{self.debug()}"
            )
            time.sleep(1)
            st = self.status()
        ids = sorted(n["id"] for n in st["nodes"])
        assert ids == sorted(up["launched"]), st
        assert all(n["state"] == "running" for n in st["nodes"]), st
        assert self.leftover(), "no head or agent runs from the node directories"
        self.cli("down", "--name", self.name, "--yes", timeout=300)
        deadline = time.monotonic() + 60
        while self.leftover():
            assert time.monotonic() < deadline, f"left running after down: {self.leftover()}"
            time.sleep(0.5)
        return st


def spec_text(name: str, section: str) -> str:
    return (
        f'name = "{name}"\n\n'
        f'[train]\nscript = "train.py"\ncheckpoint_every = 5\npython = "{sys.executable}"\n'
        'env = { TRAIN_STEP_SLEEP_S = "0.05", TRAIN_DATASET_SIZE = "4096" }\n\n' + section
    )


def test_up_status_down_on_moto_leaves_nothing(
    moto_url: str,
    ec2: Any,
    ami: str,
    sshd: Sshd,  # noqa: F811
    client_key: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    name = f"flow{uuid.uuid4().hex[:8]}"
    section = (
        f'[aws]\nregion = "{REGION}"\nami = "{ami}"\ninstance_types = ["g5.xlarge"]\n'
        'zones = ["us-east-1a"]\nssh_cidr = "127.0.0.1/32"\n'
    )
    flow = Flow(tmp_path, sshd, client_key, spec_text(name, section), name)
    flow.env["AWS_ENDPOINT_URL"] = moto_url
    flt = [{"Name": "tag:spotctl:cluster", "Values": [name]}]
    try:
        st = flow.run("aws", nodes=2)
        assert st["world_size"] == 2
        # the instances were real moto instances: 2 spot workers and an on-demand head
        raw = [
            i for r in ec2.describe_instances(Filters=flt)["Reservations"] for i in r["Instances"]
        ]
        roles = sorted(t["Value"] for i in raw for t in i["Tags"] if t["Key"] == "spotctl:role")
        assert roles == ["head", "worker", "worker"]
        # nothing left: every instance terminated, no security group, no key pair
        assert {i["State"]["Name"] for i in raw} == {"terminated"}
        assert ec2.describe_security_groups(Filters=flt)["SecurityGroups"] == []
        assert ec2.describe_key_pairs(Filters=flt)["KeyPairs"] == []
        assert flow.leftover() == []
    finally:
        if (tmp_path / "home" / "state.db").exists():
            flow.cli("down", "--name", name, "--yes", check=False)
        flow.kill_leftovers()
