"""`up -> status -> down` on GCP through the real CLI: the fake Compute REST server
(tests/gcp/fake_compute.py) for the API, and a real loopback sshd standing in for every VM
(head included).

Test seam (documented in spotctl/remote/bootstrap.py and spotctl/providers/gcp/provider.py;
set by tests/conftest.py's CloudFlow): SPOTCTL_SSH_OVERRIDE=127.0.0.1:PORT sends every VM's
SSH to the sshd fixture, SPOTCTL_SSH_OVERRIDE_KEY is the key it accepts, SPOTCTL_HEAD_PORTS
picks free head ports, SPOTCTL_SSH_REMOTE_ROOT puts the node directories under tmp_path,
and SPOTCTL_METADATA_URL points each agent at its own metadata emulator (GCP metadata
server) behind tests/conftest.py's MetadataRouter. The head and the agents (torchrun + the
train script) really run.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conftest import CloudFlow, run_spanning_group_flow

from .conftest import GCP_NOTHING, gcp_leftovers
from .fake_compute import FakeCompute

pytestmark = [pytest.mark.gcp, pytest.mark.slow, pytest.mark.timeout(900)]


def test_up_status_down_on_fake_compute_leaves_nothing(
    gcp_flow: Callable[..., CloudFlow], fake: FakeCompute
) -> None:
    flow = gcp_flow("g2-standard-4")
    st = flow.run("gcp", nodes=2)
    assert st["world_size"] == 2
    # 2 spot workers and a standard head were created through the API ...
    inserts = fake.calls("instances.insert")
    models = sorted(c.body["scheduling"]["provisioningModel"] for c in inserts)
    assert models == ["SPOT", "SPOT", "STANDARD"]
    # ... and nothing is left: no VM, firewall rule, service account, binding or process
    assert gcp_leftovers(fake) == GCP_NOTHING
    assert flow.leftover() == []


def test_four_nodes_up_status_notice_down_on_fake_compute_leave_nothing(
    gcp_flow: Callable[..., CloudFlow], fake: FakeCompute
) -> None:
    """Several VMs on GCP through the whole CLI: `up --gpus 2..4` on 1-GPU g2-standard-4,
    status, a Spot preemption (instance/preempted turns TRUE) for one node, down: nothing
    left. The same flow at 8 nodes runs on AWS (tests/aws/test_up_flow.py: the bootstrap,
    the head and `down` are shared), and 16 GCP workers at the API in tests/gcp/test_scale.py;
    8 nodes here took 126 s of CI (16: 230 s) for nothing more."""
    flow = gcp_flow("g2-standard-4", script="idle.py")
    out = flow.up_notice_down("gcp", "2..4", 4)
    assert out["leaks"] == [], out
    names = [c.body["name"] for c in fake.calls("instances.insert")]
    # 4 Spot workers and the head, each inserted once; and the replacement of the noticed
    # node when the head's own loop acted on the notice before `down` paused it
    assert len(names) == len(set(names)) and len(names) in (5, 6), names
    assert [c.body["labels"]["spotctl-role"] for c in fake.calls("instances.insert")
            ].count("head") == 1
    assert gcp_leftovers(fake) == GCP_NOTHING
    assert flow.leftover() == []
    assert flow.state_left() == CloudFlow.CLEAN


def test_one_replica_group_spans_two_instances_on_fake_compute(
    gcp_flow: Callable[..., CloudFlow], fake: FakeCompute
) -> None:
    """`[train] nodes_per_replica = 2` on GCP: two spot VMs make one replica group under
    one torchrun (tests/conftest.py's run_spanning_group_flow says what is checked). The
    torchft engine on GCP: the head VM's `spotctl head` runs torchft's Lighthouse, both
    nodes' agents are configured with it and the group trains in its quorum (one replica
    per node is the AWS test's: tests/aws/test_up_flow.py). `down` leaves nothing."""
    flow = gcp_flow("g2-standard-4")
    out = run_spanning_group_flow(flow, "gcp")
    lighthouse = out["head_json"]["lighthouse"]
    assert lighthouse.startswith("http://127.0.0.1:"), out["head_json"]
    assert out["head"]["lighthouse"] == lighthouse, out["head"]  # recorded in the state dir
    for node, cfg in out["agents"].items():
        assert (cfg["engine"], cfg["lighthouse"]) == ("torchft", lighthouse), (node, cfg)
    # the group's replica (g0, both nodes' ranks) is in the Lighthouse's quorum
    assert "<b>g0:" in out["lighthouse_status"], out["lighthouse_status"]
    assert gcp_leftovers(fake) == GCP_NOTHING
    assert flow.leftover() == []
