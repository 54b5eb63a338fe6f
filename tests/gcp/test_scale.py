"""16 Spot VMs at once on the fake Compute API (which refuses what GCP refuses): parallel
inserts, listing, a reclaimed VM replaced, and a cleanup that leaves nothing.
(The full CLI flow with SSH bootstrap, 2 and 4 nodes, is tests/gcp/test_up_flow.py.)"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gcp


def test_sixteen_l4_workers_launch_list_replace_and_leave_nothing(fake, provider):
    fake.insert_latency_s = 0.05
    offer = next(
        o for o in provider.offers()
        if o.zone == "us-central1-a" and o.instance_type == "g2-standard-4"
    )  # fmt: skip
    provider.prepare()
    got = provider.launch(offer, 16, "wide")
    assert len(got) == 16 and all(i.state == "running" for i in got)
    assert fake.max_parallel_inserts > 1
    bodies = [c.body for c in fake.calls("instances.insert")]
    assert all(b["networkInterfaces"][0]["nicType"] == "GVNIC" for b in bodies)
    # A reclaimed VM (Spot VMs are deleted on preemption) is replaced by a new request.
    del fake.instances[(got[0].zone, got[0].id)]
    [new] = provider.launch(offer, 1, "replace-1")
    live = {i.id for i in provider.list("demo")}
    assert new.id in live and got[0].id not in live and len(live) == 16
    assert provider.cleanup() == []
    assert fake.instances == {} and fake.firewalls == {}
