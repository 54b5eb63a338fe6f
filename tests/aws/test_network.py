"""AWS images and networks on moto: the AMI named by an SSM parameter with a root volume
sized for it, and a region whose account has no default VPC (tagged VPC, subnet per zone)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import boto3
import pytest

from spotctl.errors import CapacityError, SpecError
from spotctl.providers.aws.provider import AwsProvider
from spotctl.providers.base import Offer

from .conftest import REGION

pytestmark = pytest.mark.aws

MakeProvider = Callable[..., AwsProvider]
NO_DEFAULT = "eu-west-3"  # this test's region: its default VPC is deleted first


def _offer(region: str, zone: str) -> Offer:
    return Offer(provider="aws", region=region, zone=zone, instance_type="g5.xlarge", gpus=1,
                 gpu_name="A10G", spot_price=0.5, on_demand_price=1.0)  # fmt: skip


def _volume_sizes(ec2: Any, instance_id: str) -> list[int]:
    vols = ec2.describe_volumes(
        Filters=[{"Name": "attachment.instance-id", "Values": [instance_id]}]
    )["Volumes"]
    return [int(v["Size"]) for v in vols]


@pytest.mark.slow  # over 4 s: out of the fast set
def test_images_come_from_ssm_parameters_with_root_volumes_sized_per_role(
    make_provider: MakeProvider, moto_url: str, ec2: Any, ami: str
) -> None:
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto_url)
    images = ec2.describe_images(Owners=["amazon"])["Images"]
    head_ami = next(i["ImageId"] for i in images if i["ImageId"] != ami)
    ssm.put_parameter(Name="/spotctl-test/dlami", Value=ami, Type="String", Overwrite=True)
    ssm.put_parameter(Name="/spotctl-test/ubuntu", Value=head_ami, Type="String", Overwrite=True)
    p = make_provider(ami="", ami_ssm_parameter="/spotctl-test/dlami",
                      head_ami_ssm_parameter="/spotctl-test/ubuntu")  # fmt: skip
    [inst] = p.launch(_offer(REGION, f"{REGION}a"), 1, "ssm-ami")
    raw = ec2.describe_instances(InstanceIds=[inst.id])["Reservations"][0]["Instances"][0]
    assert raw["ImageId"] == ami
    assert _volume_sizes(ec2, inst.id) == [100]  # workers: 100 GB root by default
    head = p.ensure_head()
    raw = ec2.describe_instances(InstanceIds=[head.instance_id])["Reservations"][0]["Instances"]
    assert raw[0]["ImageId"] == head_ami  # the head: a small CPU image of its own
    assert _volume_sizes(ec2, head.instance_id) == [20]
    assert p.cleanup() == []
    missing = make_provider(ami="", ami_ssm_parameter="/spotctl-test/none")
    with pytest.raises(SpecError, match=r"aws\.ami: .*/spotctl-test/none") as e:
        missing.launch(_offer(REGION, f"{REGION}a"), 1, "no-ami")
    assert "\n" not in str(e.value)


def _delete_default_vpc(ec2: Any) -> None:
    for vpc in ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]:
        vid = vpc["VpcId"]
        for sn in ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vid]}])["Subnets"]:
            ec2.delete_subnet(SubnetId=sn["SubnetId"])
        igws = ec2.describe_internet_gateways(
            Filters=[{"Name": "attachment.vpc-id", "Values": [vid]}]
        )["InternetGateways"]
        for igw in igws:
            ec2.detach_internet_gateway(InternetGatewayId=igw["InternetGatewayId"], VpcId=vid)
            ec2.delete_internet_gateway(InternetGatewayId=igw["InternetGatewayId"])
        ec2.delete_vpc(VpcId=vid)


@pytest.mark.slow  # over 4 s: out of the fast set
def test_account_without_default_vpc_uses_the_tagged_vpc_and_a_subnet_per_zone(
    make_provider: MakeProvider, moto_url: str
) -> None:
    ec2 = boto3.client("ec2", region_name=NO_DEFAULT, endpoint_url=moto_url)
    _delete_default_vpc(ec2)
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    bare = make_provider(region=NO_DEFAULT, ami=ami)
    with pytest.raises(SpecError, match="no default VPC and no VPC tagged spotctl:vpc=true"):
        bare.launch(_offer(NO_DEFAULT, f"{NO_DEFAULT}a"), 1, "no-vpc")

    vpc = ec2.create_vpc(
        CidrBlock="10.20.0.0/16",
        TagSpecifications=[{"ResourceType": "vpc", "Tags": [{"Key": "spotctl:vpc", "Value": "true"}]}],
    )["Vpc"]["VpcId"]  # fmt: skip
    subnets = {
        z: ec2.create_subnet(VpcId=vpc, CidrBlock=cidr, AvailabilityZone=f"{NO_DEFAULT}{z}")[
            "Subnet"
        ]["SubnetId"]
        for z, cidr in (("a", "10.20.1.0/24"), ("b", "10.20.2.0/24"))
    }
    p = make_provider(region=NO_DEFAULT, ami=ami)
    got = p.launch(_offer(NO_DEFAULT, f"{NO_DEFAULT}b"), 2, "tagged-vpc")
    raw = [
        i
        for r in ec2.describe_instances(InstanceIds=[i.id for i in got])["Reservations"]
        for i in r["Instances"]
    ]
    assert {i["SubnetId"] for i in raw} == {subnets["b"]}
    assert {i["VpcId"] for i in raw} == {vpc}
    assert all(i.public_address for i in got)  # SSH from the controller needs one
    [group] = {g["GroupId"] for i in raw for n in i["NetworkInterfaces"] for g in n["Groups"]}
    assert ec2.describe_security_groups(GroupIds=[group])["SecurityGroups"][0]["VpcId"] == vpc
    # A zone where the VPC has no subnet is no place to launch: fail over, like capacity.
    with pytest.raises(CapacityError, match="no subnet"):
        p.launch(_offer(NO_DEFAULT, f"{NO_DEFAULT}c"), 1, "no-subnet")
    # Configured subnets restrict the choice; one outside the VPC is a spec error.
    pinned = make_provider(region=NO_DEFAULT, ami=ami, vpc_id=vpc, subnet_ids=[subnets["a"]])
    [one] = pinned.launch(_offer(NO_DEFAULT, f"{NO_DEFAULT}a"), 1, "pinned")
    assert ec2.describe_instances(InstanceIds=[one.id])["Reservations"][0]["Instances"][0][
        "SubnetId"
    ] == subnets["a"]  # fmt: skip
    wrong = make_provider(region=NO_DEFAULT, ami=ami, subnet_ids=["subnet-0000000000"])
    with pytest.raises(SpecError, match="aws.subnet_ids"):
        wrong.launch(_offer(NO_DEFAULT, f"{NO_DEFAULT}a"), 1, "wrong")
    assert p.cleanup() == [] and pinned.cleanup() == []
