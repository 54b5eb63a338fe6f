"""The head's role ([rebalance] on_head): what its reconcile loop calls on EC2 is what the
role allows, and the role is scoped to its cluster.

The loop's provider runs in head mode against moto through the fault proxy, which
records every EC2 call: it finds the group and key `up` made (creates nothing), launches a
tagged replacement, reads a console, lists and terminates. moto cannot judge the scope
itself: it evaluates EC2 permissions against the resource "*", so the role's
resource-level statements (instances tagged for this cluster, the workers' role only) are
checked here as a document, and the launch request is checked to carry the tags they
require."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import boto3
import pytest

from spotctl.providers.aws.provider import AwsProvider

from .conftest import REGION, FaultProxy

pytestmark = pytest.mark.aws

WRITES = ("ec2:Create", "ec2:Delete", "ec2:Authorize", "ec2:Revoke", "ec2:Import",
          "ec2:Modify", "ec2:Allocate", "ec2:Associate", "ec2:Release")  # fmt: skip


def _actions(st: dict[str, Any]) -> list[str]:
    a = st["Action"]
    return [a] if isinstance(a, str) else list(a)


def test_the_heads_loop_calls_only_what_its_scoped_role_allows(
    make_provider: Callable[..., AwsProvider], fault_proxy: FaultProxy, moto_url: str
) -> None:
    ctl = make_provider(instance_types=["g5.xlarge", "p4d.24xlarge"])
    name = ctl.ctx.cluster
    assert ctl.ctx.spec.head_rebalances
    ctl.prepare()  # `up`: group, key, bucket, the workers' role and the head's
    head = ctl.ensure_head()
    offer = next(o for o in ctl.offers() if o.instance_type == "g5.xlarge")
    (old,) = ctl.launch(offer, 1, "req-ctl")
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto_url)
    raw = ec2.describe_instances(InstanceIds=[head.instance_id])["Reservations"][0]["Instances"][0]
    assert raw["IamInstanceProfile"]["Arn"].endswith(f"instance-profile/spotctl-{name}-head")

    on = make_provider(name=name, instance_types=["g5.xlarge", "p4d.24xlarge"],
                       options={"endpoint_url": fault_proxy.url, "on_head": head.instance_id})
    on.prepare()
    assert on.ensure_head().instance_id == head.instance_id  # itself, nothing started
    (new,) = on.launch(next(o for o in on.offers() if o.instance_type == "g5.xlarge"), 1,
                       "req-head")
    # an EFA type: its placement group, made by the head in a zone the cluster had none
    (efa,) = on.launch(next(o for o in on.offers() if o.instance_type == "p4d.24xlarge"), 1,
                       "req-head-efa")
    # ... and its public address, an Elastic IP of the cluster (several EFA interfaces)
    assert on._ensure_public_address(on._wait_running(efa.id)).get("PublicIpAddress")
    assert {i.id for i in on.list(name)} >= {old.id, new.id, efa.id, head.instance_id}
    on.console_host_keys(new.id)
    on.terminate([old.id])

    called = {f"ec2:{a}" for a, _, _ in fault_proxy.seen if a}
    policy = on.head_policy()
    allowed = {a for st in policy["Statement"] for a in _actions(st)}
    assert called <= allowed, f"the head's loop calls what its role refuses: {called - allowed}"
    made = sorted(a for a in called if a.startswith(WRITES))
    assert made == ["ec2:AllocateAddress", "ec2:AssociateAddress",
                    "ec2:CreatePlacementGroup"], called
    assert len(fault_proxy.calls("RunInstances")) == 2  # the replacements, not a head
    # the launch carries the tags the role requires of what it creates
    # (the proxy records the form as "key=value key=value ...")
    body = {k: [v] for k, _, v in (kv.partition("=") for kv in
                                   fault_proxy.calls("RunInstances")[0].split(" "))}
    specs: dict[str, dict[str, str]] = {}
    for k, v in body.items():
        if k.startswith("TagSpecification.") and k.endswith(".ResourceType"):
            n = k.split(".")[1]
            tags = {body[f"TagSpecification.{n}.Tag.{t}.Key"][0]:
                    body[f"TagSpecification.{n}.Tag.{t}.Value"][0]
                    for t in range(1, 10) if f"TagSpecification.{n}.Tag.{t}.Key" in body}
            specs[v[0]] = tags
    assert specs["instance"]["spotctl:cluster"] == name, specs
    assert specs["volume"]["spotctl:cluster"] == name, specs
    assert body["IamInstanceProfile.Name"] == [f"spotctl-{name}-node"], body

    # the role's scope, statement by statement
    by_action: dict[str, list[dict[str, Any]]] = {}
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow"
        for a in _actions(st):
            by_action.setdefault(a, []).append(st)
    for st in by_action["ec2:TerminateInstances"] + by_action["ec2:GetConsoleOutput"]:
        assert st["Condition"] == {"StringEquals": {"ec2:ResourceTag/spotctl:cluster": name}}
    for st in by_action["ec2:RunInstances"]:
        res = json.dumps(st["Resource"])
        if "instance/" in res:  # issue 60: of the cluster's types only
            assert st["Condition"] == {"StringEquals": {
                "aws:RequestTag/spotctl:cluster": name,
                "ec2:InstanceType": ["g5.xlarge", "p4d.24xlarge"]}}, st
        if "volume/" in res:
            assert st["Condition"] == {
                "StringEquals": {"aws:RequestTag/spotctl:cluster": name}}, st
        if "image/" in res:  # the pinned AMI, of its owner (tests/aws/test_iam_scope.py)
            assert st["Resource"] == [f"arn:aws:ec2:{REGION}::image/{on.spec.ami}"], st
            assert st["Condition"]["StringEquals"]["ec2:Owner"][0] == "amazon", st
        if "subnet/" in res:
            assert st["Condition"] == {"StringEquals": {"ec2:Vpc": (
                f"arn:aws:ec2:{REGION}:{on.account_id()}:vpc/{on._vpc()[0]}")}}, st
        if "security-group/" in res or "key-pair/" in res:
            assert st["Condition"] == {
                "StringEquals": {"ec2:ResourceTag/spotctl:cluster": name}}, st
    [tag] = by_action["ec2:CreateTags"]
    assert tag["Condition"] == {"StringEquals": {
        "ec2:CreateAction": ["RunInstances", "CreatePlacementGroup", "AllocateAddress"]}}
    [alloc] = by_action["ec2:AllocateAddress"]
    assert alloc["Resource"].endswith(":elastic-ip/*"), alloc
    assert alloc["Condition"] == {"StringEquals": {"aws:RequestTag/spotctl:cluster": name}}
    eip, eni = sorted(by_action["ec2:AssociateAddress"], key=lambda st: st["Resource"])
    assert eip["Resource"].endswith(":elastic-ip/*") and eip["Condition"] == {
        "StringEquals": {"ec2:ResourceTag/spotctl:cluster": name}}, eip
    assert eni["Resource"].endswith(":network-interface/*"), eni
    [pg] = by_action["ec2:CreatePlacementGroup"]
    assert pg["Resource"].endswith(f":placement-group/spotctl-{name}-*"), pg
    assert pg["Condition"] == {"StringEquals": {"aws:RequestTag/spotctl:cluster": name}}
    [pas] = by_action["iam:PassRole"]
    assert pas["Resource"].endswith(f":role/spotctl-{name}-node"), pas
    assert {a for a in allowed if not a.startswith(("ec2:", "kms:"))} == {
        "iam:PassRole", "ssm:GetParameter"}
    # an account that encrypts new volumes with its own key: the launch uses that key
    # through EC2, and only so (moto checks no KMS use at RunInstances: the document)
    via_ec2 = {"kms:ViaService": f"ec2.{REGION}.amazonaws.com"}
    for a in [a for a in allowed if a.startswith("kms:")]:
        for st in by_action[a]:
            assert st["Resource"] == f"arn:aws:kms:{REGION}:{on.account_id()}:key/*", st
            assert st["Condition"]["StringEquals"] == via_ec2, st
    assert {a for a in allowed if a.startswith("kms:")} == {
        "kms:CreateGrant", "kms:Decrypt", "kms:DescribeKey",
        "kms:GenerateDataKeyWithoutPlaintext", "kms:ReEncryptFrom", "kms:ReEncryptTo"}
    [grant] = by_action["kms:CreateGrant"]
    assert grant["Condition"]["Bool"] == {"kms:GrantIsForAWSResource": "true"}, grant
    # what `up` put on the role in IAM is this document
    iam = boto3.client("iam", region_name=REGION, endpoint_url=moto_url)
    doc = iam.get_role_policy(RoleName=f"spotctl-{name}-head",
                              PolicyName="spotctl-replace-nodes")["PolicyDocument"]
    assert (json.loads(doc) if isinstance(doc, str) else doc) == policy
    on.terminate([new.id, efa.id])
    assert ctl.cleanup() == []
    assert not [r for r in iam.list_roles()["Roles"] if r["RoleName"].startswith(f"spotctl-{name}")]


def test_the_head_makes_nothing_the_controller_did_not(
    make_provider: Callable[..., AwsProvider],
) -> None:
    """A head whose cluster lost its group (taken down meanwhile) says so and creates none."""
    p = make_provider(instance_types=["g5.xlarge"], options={"on_head": "i-0123456789abcdef0"})
    with pytest.raises(Exception, match="no security group"):
        p.prepare()


def test_down_ends_an_instance_the_head_launched_while_it_listed(
    make_provider: Callable[..., AwsProvider], moto_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The head's loop can be mid-launch when `down` lists the cluster (its pause waited in
    vain, or the head could not be reached): that instance appears after the list, and
    down ends it too instead of leaving it billing."""
    from .conftest import aws_leftovers

    p = make_provider(instance_types=["g5.xlarge"])
    p.prepare()
    head = p.ensure_head()
    offer = next(o for o in p.offers() if o.instance_type == "g5.xlarge")
    p.launch(offer, 1, "req-1")
    on = make_provider(name=p.ctx.cluster, instance_types=["g5.xlarge"],
                       options={"on_head": head.instance_id})
    real = AwsProvider.terminate
    late: list[str] = []

    def terminate(self: AwsProvider, ids: Any) -> None:
        if not late:  # the head's launch lands just after down's list
            late.extend(i.id for i in on.launch(offer, 1, "req-late"))
        real(self, ids)

    monkeypatch.setattr(AwsProvider, "terminate", terminate)
    assert p.cleanup() == []
    assert late and aws_leftovers(p.ctx.cluster, moto_url)["instances"] == []


def test_the_heads_credentials_are_refused_what_its_role_does_not_grant(
    make_provider: Callable[..., AwsProvider], moto_url: str
) -> None:
    """With moto's IAM enforcement on and the head role's credentials (assumed through
    STS, as EC2 hands them to the head VM): what the role lists by action is allowed, and
    everything a compromised head would want beyond replacing workers is refused: making
    roles or passing itself, opening the security group, deleting the key pair, reading
    or writing the checkpoints. (moto judges EC2 calls against the resource "*", so the
    role's instance-level statements are tested as a document above, not here.)"""
    import boto3

    from .test_node_checkpoint_iam import _assume_node_role, iam_enforced

    p = make_provider(instance_types=["g5.xlarge"])
    p.prepare()
    p.ensure_head()
    gid, key = p._prepared or ("", "")
    bucket = p.bucket_name()
    env = _assume_node_role(moto_url, p.head_profile)
    kw = {"region_name": REGION, "endpoint_url": moto_url,
          "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
          "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
          "aws_session_token": env["AWS_SESSION_TOKEN"]}  # fmt: skip
    ec2, iam, s3 = (boto3.client(s, **kw) for s in ("ec2", "iam", "s3"))
    with iam_enforced(moto_url):
        ec2.describe_instances()  # the role's reads
        ec2.describe_security_groups(GroupIds=[gid])
        refused = [
            lambda: iam.create_role(RoleName="x", AssumeRolePolicyDocument="{}"),
            lambda: iam.put_role_policy(RoleName=p.head_profile, PolicyName="more",
                                        PolicyDocument="{}"),
            lambda: ec2.authorize_security_group_ingress(
                GroupId=gid, IpPermissions=[{"IpProtocol": "tcp", "FromPort": 22,
                                             "ToPort": 22,
                                             "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]),
            lambda: ec2.delete_key_pair(KeyName=key),
            lambda: ec2.create_security_group(GroupName="x", Description="x"),
            lambda: s3.get_object(Bucket=bucket, Key=f"{p.ctx.cluster}/checkpoints/x"),
            lambda: s3.put_object(Bucket=bucket, Key=f"{p.ctx.cluster}/x", Body=b"x"),
        ]  # fmt: skip
        for call in refused:
            with pytest.raises(Exception, match="AccessDenied|UnauthorizedOperation|403"):
                call()
    assert p.cleanup() == []


@pytest.mark.parametrize("param,want", [
    ("/team/images/train", "arn:aws:ssm:{region}:{acct}:parameter/team/images/train"),
    ("arn:aws:ssm:us-east-1:999999999999:parameter/shared/ami",
     "arn:aws:ssm:us-east-1:999999999999:parameter/shared/ami"),
    (None, None),  # AWS's public parameter: the /aws/service/ grant covers it
])
def test_the_head_may_read_the_workers_own_image_parameter(
    make_provider: Callable[..., AwsProvider], param: str | None, want: str | None, ami: str
) -> None:
    """aws.ami_ssm_parameter of the user's own: the head resolves it for every launch, so
    its role may read that one parameter (it was refused: only /aws/service/ was)."""
    p = make_provider(instance_types=["g5.xlarge"], ami="",
                      **({"ami_ssm_parameter": param} if param else {}))
    p._amis[param or p.spec.ami_ssm_parameter] = ami  # what the parameter names (not in moto)
    [st] = [s for s in p.head_policy()["Statement"] if s["Sid"] == "ImageNames"]
    public = f"arn:aws:ssm:{REGION}::parameter/aws/service/*"
    if want is None:
        assert st["Resource"] == [public], st
    else:
        assert st["Resource"] == [public, want.format(region=REGION, acct=p.account_id())], st
