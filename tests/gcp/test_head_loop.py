"""The GCP head replaces a lost worker by itself ([rebalance] on_head), with nothing
running on the controller: the fake Compute API for the VMs, the loopback sshd for every
VM. tests/conftest.py's run_head_replacement_flow: `up`, a preemption (the worker's
metadata says so, then GCP deletes the VM), the head's loop inserts and bootstraps the
replacement; judged by the workers' own step records and the controller's journal. Here
also: the fake's insert. Under the seam the head's loop reaches the fake anonymously,
like the controller: the head's account and its scope are
tests/gcp/test_head_identity.py's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CloudFlow, run_head_replacement_flow

from .conftest import GCP_NOTHING, gcp_leftovers

pytestmark = [pytest.mark.gcp, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_gcp_head_replaces_a_preempted_worker(
    gcp_flow: Callable[..., CloudFlow], fake: Any, tmp_path: Path
) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    flow = gcp_flow("g2-standard-4", env={"SPOTCTL_TRACE_SAMPLES": str(trace),
                                          "TRAIN_DATASET_SIZE": "100000"})

    def delete(vm: str) -> None:  # instance_termination_action=DELETE
        [key] = [k for k in fake.instances if k[1] == vm]
        del fake.instances[key]

    inserts_before = len(fake.calls("instances.insert"))
    new = run_head_replacement_flow(flow, "gcp", trace, delete)["new"]
    # the replacement is a spot worker of this cluster, running as the workers' account
    [ins] = [c for c in fake.calls("instances.insert")[inserts_before:]
             if c.body["name"] == new]
    assert ins.body["labels"]["spotctl-role"] == "worker", ins.body["labels"]
    assert ins.body["serviceAccounts"][0]["email"].startswith("spotctl-"), ins.body

    out = flow.down()
    assert out["leaks"] == [], out
    assert gcp_leftovers(fake) == GCP_NOTHING
