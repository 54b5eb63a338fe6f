"""Issue 60, finding 6: the head's role and the controller's policy template are scoped to
the cluster's image owner, instance types, VPC and cluster tag, and the stand-in refuses
what AWS's IAM refuses under them.

moto judges EC2 calls by action only (tests/aws/test_node_checkpoint_iam.py), so EC2 goes
through `IamEc2Proxy` (tests/aws/iam_ec2.py), which evaluates each resource a call
touches against the caller's own policy, with the condition keys AWS documents for it
(Service Authorization Reference, "Actions, resources, and condition keys for Amazon
EC2": `ec2:InstanceType` on the instance, `ec2:Owner` on the image, `ec2:Vpc` on the
subnet and network interface, `aws:RequestTag/<key>` and `ec2:ResourceTag/<key>`; EC2 User
Guide, "Example policies to control access the Amazon EC2 API", "Launch instances
(RunInstances)"). An identity holding exactly the policy does its part of `up`, a
notice's replacement and `down`; the same identity is refused another instance type,
another owner's image (the account's own private AMI), another VPC, another cluster's tag
and another cluster's instances. On the code before this change the head's role allowed
every one of those (its image, subnet and instance statements had no condition)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from spotctl.errors import AuthError
from spotctl.providers.aws import catalog as catalog_aws
from spotctl.providers.aws.provider import AwsProvider
from spotctl.spec import AwsSpec

from .conftest import REGION
from .iam_ec2 import IamEc2Proxy, allows

pytestmark = pytest.mark.aws

TEMPLATE = Path(__file__).parents[2] / "templates" / "aws-iam-policy.json"
ACCOUNT = "123456789012"  # moto's


@pytest.fixture
def proxy(moto_url: str) -> Iterator[IamEc2Proxy]:
    p = IamEc2Proxy(moto_url, REGION, ACCOUNT).start()
    try:
        yield p
    finally:
        p.stop()


def _admin(moto_url: str, svc: str) -> Any:
    return boto3.client(svc, region_name=REGION, endpoint_url=moto_url,
                        aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip


def _as(creds: dict[str, str], url: str) -> Any:
    return boto3.client("ec2", region_name=REGION, endpoint_url=url, **creds)


def _refused(call: Callable[[], Any]) -> None:
    with pytest.raises(ClientError) as e:
        call()
    assert e.value.response["Error"]["Code"] == "UnauthorizedOperation", e.value.response


def _private_ami(moto_url: str, ami: str) -> str:
    """An image of the account's own (no alias, owner = the account), as a team's private
    AMI would be."""
    ec2 = _admin(moto_url, "ec2")
    i = ec2.run_instances(ImageId=ami, InstanceType="t3.micro", MinCount=1,
                          MaxCount=1)["Instances"][0]["InstanceId"]  # fmt: skip
    img = ec2.create_image(InstanceId=i, Name=f"private-{uuid.uuid4().hex[:6]}")["ImageId"]
    ec2.terminate_instances(InstanceIds=[i])
    assert not ec2.describe_images(ImageIds=[img])["Images"][0].get("ImageOwnerAlias")
    return str(img)


def _other_vpc_subnet(moto_url: str) -> str:
    ec2 = _admin(moto_url, "ec2")
    vpc = ec2.create_vpc(CidrBlock="10.77.0.0/16")["Vpc"]["VpcId"]
    return str(ec2.create_subnet(VpcId=vpc, CidrBlock="10.77.1.0/24",
                                 AvailabilityZone=f"{REGION}a")["Subnet"]["SubnetId"])  # fmt: skip


def _someone_elses(moto_url: str, ami: str, cluster: str | None) -> str:
    tags = [{"ResourceType": "instance", "Tags": [{"Key": "spotctl:cluster", "Value": cluster}]}]
    return str(_admin(moto_url, "ec2").run_instances(
        ImageId=ami, InstanceType="g5.xlarge", MinCount=1, MaxCount=1,
        **({"TagSpecifications": tags} if cluster else {}))["Instances"][0]["InstanceId"])


def _retag(kw: dict[str, Any], cluster: str) -> dict[str, Any]:
    specs = json.loads(json.dumps(kw["TagSpecifications"]).replace(
        '"Value": "' + kw["TagSpecifications"][0]["Tags"][0]["Value"] + '"',
        f'"Value": "{cluster}"'))  # fmt: skip
    return {**kw, "TagSpecifications": specs, "ClientToken": uuid.uuid4().hex}


@pytest.mark.slow  # a cluster's lifecycle on moto (~5 s idle, 30-40 s at load 40)
def test_the_heads_role_replaces_its_workers_and_nothing_wider(
    make_provider: Callable[..., AwsProvider], moto_url: str, ami: str, proxy: IamEc2Proxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from .test_node_checkpoint_iam import _assume_node_role

    ctl = make_provider(instance_types=["g5.xlarge"])
    name = ctl.ctx.cluster
    ctl.prepare()  # `up`: the head's role with its policy
    head = ctl.ensure_head()
    offer = next(o for o in ctl.offers() if o.instance_type == "g5.xlarge")
    (old,) = ctl.launch(offer, 1, "req-up")
    doc = _admin(moto_url, "iam").get_role_policy(
        RoleName=ctl.head_profile, PolicyName="spotctl-replace-nodes")["PolicyDocument"]
    policy = json.loads(doc) if isinstance(doc, str) else doc
    env = _assume_node_role(moto_url, ctl.head_profile)  # what EC2 hands the head VM
    proxy.policies[env["AWS_ACCESS_KEY_ID"]] = policy
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    on = make_provider(name=name, instance_types=["g5.xlarge"],
                       options={"endpoint_url": proxy.url, "on_head": head.instance_id})
    on.prepare()
    # a notice on `old`: the head's loop launches its replacement and ends it
    (new,) = on.launch(offer, 1, "req-notice")
    on.terminate([old.id])
    assert proxy.refused == [], proxy.refused
    assert {"RunInstances", "TerminateInstances"} <= set(proxy.allowed)

    creds = {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
             "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
             "aws_session_token": env["AWS_SESSION_TOKEN"]}  # fmt: skip
    ec2 = _as(creds, proxy.url)
    kw = on.launch_request(instance_type="g5.xlarge", zone=offer.zone, count=1,
                           request_id="req-probe", token=uuid.uuid4().hex, role="worker",
                           tags={}, spot=True)  # fmt: skip
    ok = ec2.run_instances(**kw)["Instances"][0]["InstanceId"]  # the request as the loop sends it
    refused = {
        "another instance type": {"InstanceType": "c5.24xlarge"},
        "another owner's image": {"ImageId": _private_ami(moto_url, ami)},
        "a subnet of another VPC": {"NetworkInterfaces": [{
            "DeviceIndex": 0, "SubnetId": _other_vpc_subnet(moto_url),
            "AssociatePublicIpAddress": True, "DeleteOnTermination": True}],
            "SecurityGroupIds": []},
    }  # fmt: skip
    for what, change in refused.items():
        req = {**kw, **change, "ClientToken": uuid.uuid4().hex}
        if not req.get("SecurityGroupIds"):
            req.pop("SecurityGroupIds", None)
        n = len(proxy.refused)
        _refused(lambda req=req: ec2.run_instances(**req))
        assert len(proxy.refused) == n + 1, what
    _refused(lambda: ec2.run_instances(**_retag(kw, "another-cluster")))
    # another cluster's instance, and one of no cluster
    for other in (_someone_elses(moto_url, ami, "another-cluster"),
                  _someone_elses(moto_url, ami, None)):  # fmt: skip
        _refused(lambda other=other: ec2.terminate_instances(InstanceIds=[other]))
        _refused(lambda other=other: ec2.get_console_output(InstanceId=other))
        state = _admin(moto_url, "ec2").describe_instances(InstanceIds=[other])
        assert state["Reservations"][0]["Instances"][0]["State"]["Name"] == "running"
    # nothing of the refused launches exists: every c5 / private-image instance is absent
    live = [i for r in _admin(moto_url, "ec2").describe_instances(Filters=[
        {"Name": "tag:spotctl:cluster", "Values": [name]}])["Reservations"]
        for i in r["Instances"] if i["State"]["Name"] != "terminated"]  # fmt: skip
    assert {i["InstanceId"] for i in live} == {head.instance_id, new.id, ok}, live
    assert {i["InstanceType"] for i in live if i["InstanceId"] != head.instance_id} == {"g5.xlarge"}
    on.terminate([new.id, ok])
    monkeypatch.undo()
    assert ctl.cleanup() == []


@pytest.mark.slow  # a cluster's lifecycle on moto (~5 s idle, 30-40 s at load 40)
def test_an_identity_holding_exactly_the_template_runs_a_cluster_and_no_more(
    make_provider: Callable[..., AwsProvider], moto_url: str, ami: str, proxy: IamEc2Proxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The controller's identity (an IAM user with templates/aws-iam-policy.json as its one
    policy): `up` (group, key, roles, head, a spot worker), a list, `down`; then the same
    keys are refused a non-GPU type, a private image and an untagged instance."""
    iam = _admin(moto_url, "iam")
    user = f"ctl-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="spotctl", PolicyDocument=TEMPLATE.read_text())
    key = iam.create_access_key(UserName=user)["AccessKey"]
    proxy.policies[key["AccessKeyId"]] = json.loads(TEMPLATE.read_text())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    p = make_provider(instance_types=["g5.xlarge"], options={"endpoint_url": proxy.url})
    p.prepare()
    head = p.ensure_head()
    offer = next(o for o in p.offers() if o.instance_type == "g5.xlarge")
    (inst,) = p.launch(offer, 1, "req-up")
    assert {i.id for i in p.list(p.ctx.cluster)} == {head.instance_id, inst.id}
    assert p.cleanup() == []
    assert proxy.refused == [], proxy.refused

    ec2 = _as({"aws_access_key_id": key["AccessKeyId"],
               "aws_secret_access_key": key["SecretAccessKey"]}, proxy.url)  # fmt: skip
    tags = [{"ResourceType": "instance", "Tags": [{"Key": "spotctl:cluster", "Value": "x"}]},
            {"ResourceType": "volume", "Tags": [{"Key": "spotctl:cluster", "Value": "x"}]}]
    base = {"ImageId": ami, "InstanceType": "g5.xlarge", "MinCount": 1, "MaxCount": 1,
            "TagSpecifications": tags}  # fmt: skip
    ok = ec2.run_instances(**base)["Instances"][0]["InstanceId"]
    _refused(lambda: ec2.run_instances(**{**base, "InstanceType": "c5.24xlarge"}))
    _refused(lambda: ec2.run_instances(**{**base, "ImageId": _private_ami(moto_url, ami)}))
    _refused(lambda: ec2.run_instances(**{k: v for k, v in base.items()
                                          if k != "TagSpecifications"}))  # fmt: skip
    _refused(lambda: ec2.terminate_instances(InstanceIds=[_someone_elses(moto_url, ami, None)]))
    ec2.terminate_instances(InstanceIds=[ok])
    # `spotctl check` DryRuns the first launch: a pinned private AMI is named in one line
    private = _private_ami(moto_url, ami)
    mine = make_provider(instance_types=["g5.xlarge"], ami=private,
                         options={"endpoint_url": proxy.url})
    with pytest.raises(AuthError, match=f"ec2:Owner for image {private}"):
        mine._check_launch()


def test_the_templates_types_are_the_catalogs_and_the_heads() -> None:
    """The template's instance types: every family the catalog offers and the head's
    default type's, nothing else (a new catalog family must be added to it)."""
    [st] = [s for s in json.loads(TEMPLATE.read_text())["Statement"]
            if s["Sid"] == "RunInstancesOnlyWithClusterTagOfGpuAndHeadTypes"]  # fmt: skip
    families = {t.split(".")[0] for t in catalog_aws.instance_types()}
    head = AwsSpec.model_fields["head_instance_type"].default.split(".")[0]
    got = st["Condition"]["StringLike"]["ec2:InstanceType"]
    assert {t.removesuffix(".*") for t in got} == families | {head}, got


@pytest.mark.parametrize("op,key,wanted,ctx,want", [
    ("StringEquals", "ec2:Owner", ["amazon"], {"ec2:Owner": ["amazon"]}, True),
    ("StringEquals", "ec2:Owner", ["amazon"], {"ec2:Owner": [ACCOUNT]}, False),
    ("StringEquals", "ec2:Owner", ["amazon"], {}, False),  # missing key: no match
    ("StringLike", "ec2:InstanceType", ["g5.*"], {"ec2:InstanceType": ["g5.xlarge"]}, True),
    ("StringLike", "ec2:InstanceType", ["g5.*"], {"ec2:InstanceType": ["g5g.xlarge"]}, False),
    ("Null", "aws:RequestTag/spotctl:cluster", ["false"], {}, False),
    ("Null", "aws:RequestTag/spotctl:cluster", ["false"],
     {"aws:RequestTag/spotctl:cluster": ["c"]}, True),
    ("StringNotEquals", "ec2:Owner", ["amazon"], {}, True),  # negated, key missing: true
])
def test_the_stand_ins_condition_operators(op: str, key: str, wanted: list[str],
                                          ctx: dict[str, list[str]], want: bool) -> None:
    """IAM User Guide, "IAM JSON policy elements: Condition operators"."""
    policy = {"Statement": [{"Effect": "Allow", "Action": "ec2:RunInstances", "Resource": "*",
                             "Condition": {op: {key: wanted}}}]}  # fmt: skip
    assert allows(policy, "ec2:RunInstances", "arn:aws:ec2:r:a:instance/*", ctx, ACCOUNT) is want
