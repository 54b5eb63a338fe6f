"""9 and 10: cloud API faults against the GCP test server (tests/gcp/fake_compute.py) with
the real GcpProvider and google-cloud-compute client over REST."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from .result import Result

REPO = Path(__file__).resolve().parents[2]


def _provider(fake, home: Path, zones: list[str]):
    from spotctl.providers.base import ProviderContext
    from spotctl.providers.gcp.provider import GcpProvider
    from spotctl.spec import ClusterSpec
    from spotctl.state import ClusterDir

    spec = ClusterSpec.model_validate(
        {
            "name": "chaos",
            "provider": "gcp",
            "gcp": {
                "project": "chaos-proj",
                "region": "us-central1",
                "zones": zones,
                "ssh_cidr": "203.0.113.7/32",
            },
        }
    )
    ctx = ProviderContext(
        cluster="chaos",
        spec=spec,
        cluster_dir=ClusterDir(home, "chaos").ensure(),
        options={
            "gcp_endpoint": fake.endpoint,
            "gcp_backoff_base": 0.05,
            "gcp_backoff_max": 0.2,
            "gcp_poll_interval": 0.01,
            "gcp_op_timeout": 30,
            "head_process": False,
        },
    )
    return GcpProvider(ctx)


def _offer(p, zone: str):
    return next(
        o
        for o in p.offers()
        if o.zone == zone
        and o.instance_type == "n1-standard-8"
        and o.gpu_name == "T4"
        and o.gpus == 1
    )


def _fake():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.gcp.fake_compute import FakeCompute

    return FakeCompute()


def capacity_everywhere() -> Result:
    """9: every zone out of capacity: one clear error, nothing left behind, a later retry
    (capacity back) succeeds."""
    from spotctl.errors import CapacityError

    res = Result("9 capacity errors in every zone")
    zones = ["us-central1-a", "us-central1-b"]
    with tempfile.TemporaryDirectory() as tmp, _fake() as fake:
        os.environ["SPOTCTL_HOME"] = tmp
        p = _provider(fake, Path(tmp), zones)
        fake.exhaust(zones[0])
        fake.exhaust(zones[1], "http503")
        t0 = time.time()
        msg = ""
        try:
            for z in zones:  # the reconciler tries every zone in turn
                try:
                    p.launch(_offer(p, z), 1, f"req-{z}")
                except CapacityError as e:
                    msg = str(e)
        except Exception as e:
            res.notes = f"wrong error type {type(e).__name__}: {e}"
            return res
        leaked = list(fake.instances)
        fake.exhausted.clear()  # capacity comes back
        insts = p.launch(_offer(p, zones[0]), 1, "req-later")
        res.recover_s = round(time.time() - t0, 1)
        res.leaks = [f"instance {i} left by a failed launch" for i in leaked]
        clear = bool(msg) and "\n" not in msg and zones[0] in msg
        res.survived = clear and not leaked and len(insts) == 1 and len(p.list("chaos")) == 1
        res.committed_steps_lost = res.steps_replayed = 0
        res.detail = {"error": msg, "later_launch": [i.id for i in insts]}
        res.notes = f"CapacityError: {msg[:70]}"
        p.terminate([i.id for i in insts])
    return res


def throttling() -> Result:
    """10: 429 and 5xx on insert and list: retried with backoff, then succeeds."""
    res = Result("10 API throttling and 5xx")
    with tempfile.TemporaryDirectory() as tmp, _fake() as fake:
        os.environ["SPOTCTL_HOME"] = tmp
        p = _provider(fake, Path(tmp), ["us-central1-a"])
        fake.fail("instances.insert", 429, "rateLimitExceeded", times=2)
        fake.fail("instances.aggregatedList", 503, "backendError", times=2)
        t0 = time.time()
        try:
            insts = p.launch(_offer(p, "us-central1-a"), 1, "req-t")
        except Exception as e:
            res.notes = f"{type(e).__name__}: {e}"
            return res
        res.recover_s = round(time.time() - t0, 2)
        inserts = len(fake.calls("instances.insert"))
        lists = len(fake.calls("instances.aggregatedList"))
        res.survived = len(insts) == 1 and inserts == 3 and len(fake.instances) == 1
        res.committed_steps_lost = res.steps_replayed = 0
        res.detail = {"insert_calls": inserts, "list_calls": lists}
        res.notes = f"insert tried {inserts}x, list {lists}x, then launched"
        p.terminate([i.id for i in insts])
    return res
