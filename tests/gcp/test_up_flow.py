"""`up -> status -> down` on GCP through the real CLI: the fake Compute REST server
(tests/gcp/fake_compute.py) for the API, and a real loopback sshd standing in for every VM
(head included).

Test seam (documented in spotctl/remote/bootstrap.py and spotctl/providers/gcp/provider.py):
SPOTCTL_SSH_OVERRIDE=127.0.0.1:PORT sends every VM's SSH to the sshd fixture,
SPOTCTL_SSH_OVERRIDE_KEY is the key it accepts, SPOTCTL_HEAD_PORTS picks free head ports
and SPOTCTL_SSH_REMOTE_ROOT puts the node directories under tmp_path (all set by `Flow`).
The head and the agents (torchrun + templates/train.py) really run.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.aws.test_up_flow import Flow, spec_text
from tests.ssh.conftest import Sshd, client_key, sshd, sshd_factory  # noqa: F401

from .conftest import PROJECT
from .fake_compute import FakeCompute

pytestmark = [pytest.mark.gcp, pytest.mark.slow, pytest.mark.timeout(900)]


def test_up_status_down_on_fake_compute_leaves_nothing(
    fake: FakeCompute,
    sshd: Sshd,  # noqa: F811
    client_key: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    name = f"flow{uuid.uuid4().hex[:8]}"
    section = (
        f'[gcp]\nproject = "{PROJECT}"\nregion = "us-central1"\nzones = ["us-central1-a"]\n'
        'machine_types = ["g2-standard-4"]\nssh_cidr = "127.0.0.1/32"\n'
    )
    flow = Flow(tmp_path, sshd, client_key, spec_text(name, section), name)
    flow.env["SPOTCTL_GCP_ENDPOINT"] = fake.endpoint
    try:
        st = flow.run("gcp", nodes=2)
        assert st["world_size"] == 2
        # 2 spot workers and a standard head were created through the API ...
        inserts = fake.calls("instances.insert")
        models = sorted(c.body["scheduling"]["provisioningModel"] for c in inserts)
        assert models == ["SPOT", "SPOT", "STANDARD"]
        # ... and nothing is left: no VM, no firewall rule, no process
        assert fake.instances == {} and fake.firewalls == {}
        assert flow.leftover() == []
    finally:
        if (tmp_path / "home" / "state.db").exists():
            flow.cli("down", "--name", name, "--yes", check=False)
        flow.kill_leftovers()
