"""16 spot workers at once on moto: one all-or-nothing launch, listing, a reclaimed node
replaced, and a cleanup that leaves no instance, group, key, role or profile behind.
(The full CLI flow with SSH bootstrap, 2 and 8 nodes, is tests/aws/test_up_flow.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import boto3
import pytest

from spotctl.providers.aws.provider import AwsProvider
from spotctl.providers.base import Offer

from .conftest import REGION

pytestmark = pytest.mark.aws


def test_sixteen_workers_launch_list_replace_and_leave_nothing(
    make_provider: Callable[..., AwsProvider], ec2: Any, moto_url: str
) -> None:
    p = make_provider()
    offer = Offer(provider="aws", region=REGION, zone=f"{REGION}b", instance_type="g5.xlarge",
                  gpus=1, gpu_name="A10G", spot_price=0.5, on_demand_price=1.0)  # fmt: skip
    got = p.launch(offer, 16, "wide")
    assert len(got) == 16 and len({i.id for i in got}) == 16
    again = p.launch(offer, 16, "wide")  # a retried `up`: the same 16, nothing new
    assert {i.id for i in again} == {i.id for i in got}
    assert len([i for i in p.list(p.ctx.cluster) if i.role == "worker"]) == 16
    # A reclaimed node: terminated by the cloud, replaced by a new request.
    ec2.terminate_instances(InstanceIds=[got[0].id])
    [new] = p.launch(offer, 1, "replace-1")
    live = {i.id for i in p.list(p.ctx.cluster) if i.state in ("pending", "running")}
    assert new.id in live and got[0].id not in live and len(live) == 16
    assert p.cleanup() == []
    assert p.list(p.ctx.cluster) == []
    name = p.ctx.cluster
    tagged = {"Name": "tag:spotctl:cluster", "Values": [name]}
    assert ec2.describe_security_groups(Filters=[tagged])["SecurityGroups"] == []
    assert ec2.describe_key_pairs(Filters=[tagged])["KeyPairs"] == []
    iam = boto3.client("iam", region_name=REGION, endpoint_url=moto_url)
    assert not [r for r in iam.list_roles()["Roles"] if r["RoleName"] == f"spotctl-{name}-node"]
