"""The shipped IAM policy allows exactly the EC2 calls the provider makes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from spotctl.errors import SpecError
from spotctl.providers.aws.provider import AwsProvider

from .conftest import FaultProxy

pytestmark = pytest.mark.aws

POLICY = Path(__file__).parents[2] / "templates" / "aws-iam-policy.json"
# Allowed for what EC2 does on the provider's behalf, not called by it directly.
IMPLICIT = {"ec2:CreateTags", "iam:CreateServiceLinkedRole"}
# Not EC2 query-protocol calls, so the fault proxy does not name them; each is asserted by
# its own test (tests/aws/test_network.py: SSM image parameters; test_check.py: quotas;
# test_storage.py: bucket, role and instance profile).
# sts:GetCallerIdentity (`spotctl check`) needs no permission.
OTHER_SERVICES = {"ssm:GetParameter", "servicequotas:GetServiceQuota"} | {
    # checkpoint storage (tests/aws/test_storage.py); TagRole / TagInstanceProfile are the
    # tags passed to CreateRole / CreateInstanceProfile, PassRole what RunInstances does
    # with the profile, s3:ListBucket what HeadBucket needs
    *(f"iam:{a}" for a in ("GetRole", "CreateRole", "TagRole", "PutRolePolicy",
                           "DeleteRolePolicy", "DeleteRole", "GetInstanceProfile",
                           "CreateInstanceProfile", "TagInstanceProfile",
                           "AddRoleToInstanceProfile", "RemoveRoleFromInstanceProfile",
                           "DeleteInstanceProfile", "PassRole")),
    *(f"s3:{a}" for a in ("CreateBucket", "PutBucketPublicAccessBlock",
                          "PutLifecycleConfiguration", "ListBucket", "DeleteObject")),
}  # fmt: skip


def _policy_actions() -> set[str]:
    actions: set[str] = set()
    for st in json.loads(POLICY.read_text())["Statement"]:
        assert st["Effect"] == "Allow"
        a = st["Action"]
        actions.update([a] if isinstance(a, str) else a)
    return actions


def test_policy_matches_the_calls_of_a_whole_lifecycle(
    make_provider: Callable[..., AwsProvider], fault_proxy: FaultProxy
) -> None:
    p = make_provider(instance_types=["g5.xlarge", "p4d.24xlarge"],
                      options={"endpoint_url": fault_proxy.url})
    offer = next(o for o in p.offers() if o.instance_type == "g5.xlarge")
    (inst,) = p.launch(offer, 1, "req-iam")
    # an EFA type: its interfaces, in the cluster's placement group of the zone
    efa = next(o for o in p.offers() if o.instance_type == "p4d.24xlarge")
    (efa_inst,) = p.launch(efa, 1, "req-iam-efa")
    # its public address: an Elastic IP of the cluster (bootstrap gives it; down frees it)
    p._ensure_public_address(p._wait_running(efa_inst.id))
    p.list(p.ctx.cluster)
    p.ensure_head()
    # the controller's address moved: the next `up` moves the SSH rule (revoking the old)
    make_provider(name=p.ctx.cluster, instance_types=["g5.xlarge"], ssh_cidr="192.0.2.99/32",
                  options={"endpoint_url": fault_proxy.url, "follow_ssh_cidr": True}
                  ).prepare()  # fmt: skip
    p.terminate([inst.id, efa_inst.id])
    assert p.cleanup() == []
    p.checks()  # `spotctl check --provider aws`
    with pytest.raises(SpecError, match="aws.ami"):  # the default-AMI lookup
        make_provider(ami="", options={"endpoint_url": fault_proxy.url})._ami()
    # STS speaks the same query protocol: its GetCallerIdentity needs no permission.
    called = {f"ec2:{a}" for a, _, _ in fault_proxy.seen if a and a != "GetCallerIdentity"}
    allowed = _policy_actions()
    assert called <= allowed, f"calls missing from the policy: {called - allowed}"
    assert OTHER_SERVICES <= allowed
    # A region without a default VPC adds subnet lookups (tests/aws/test_network.py).
    called.add("ec2:DescribeSubnets")
    assert allowed - IMPLICIT - OTHER_SERVICES <= called, (
        f"policy allows unused calls: {allowed - IMPLICIT - OTHER_SERVICES - called}"
    )
    assert not any(a.endswith("*") for a in allowed)
