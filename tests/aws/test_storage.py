"""Checkpoint storage per cluster on moto: a private bucket, the cluster's prefix as the
default checkpoint_dir, an instance profile scoped to that prefix on every worker, and
`down` that removes the identity but keeps the checkpoints unless purged."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import boto3
import pytest

from spotctl.errors import SpecError
from spotctl.providers.aws.provider import AwsProvider
from spotctl.providers.base import Offer

from .conftest import REGION

pytestmark = pytest.mark.aws

MakeProvider = Callable[..., AwsProvider]


def _offer() -> Offer:
    return Offer(provider="aws", region=REGION, zone=f"{REGION}a", instance_type="g5.xlarge",
                 gpus=1, gpu_name="A10G", spot_price=0.5, on_demand_price=1.0)  # fmt: skip


def test_cluster_prefix_profile_and_down_keeps_checkpoints(
    make_provider: MakeProvider, moto_url: str, ec2: Any
) -> None:
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=moto_url)
    iam = boto3.client("iam", region_name=REGION, endpoint_url=moto_url)
    p = make_provider()
    name = p.ctx.cluster
    [inst] = p.launch(_offer(), 1, "ckpt")
    bucket = f"spotctl-123456789012-{REGION}"
    # The default checkpoint_dir on AWS is the cluster's prefix in the bucket.
    assert p.ctx.spec.train.checkpoint_dir == f"s3://{bucket}/{name}/checkpoints"
    block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    assert all(block.values())
    # a save's multipart upload left open by a killed node is aborted by S3 after a day
    [rule] = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    assert rule["Status"] == "Enabled" and rule["Filter"] == {"Prefix": ""}, rule
    assert rule["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 1}, rule
    # The worker runs with the cluster's instance profile, whose role reaches only the prefix.
    raw = ec2.describe_instances(InstanceIds=[inst.id])["Reservations"][0]["Instances"][0]
    assert raw["IamInstanceProfile"]["Arn"].endswith(f"instance-profile/spotctl-{name}-node")
    doc = iam.get_role_policy(RoleName=f"spotctl-{name}-node", PolicyName="spotctl-checkpoints")
    policy = doc["PolicyDocument"]
    policy = json.loads(policy) if isinstance(policy, str) else policy
    resources = [st["Resource"] for st in policy["Statement"]]
    assert resources == [f"arn:aws:s3:::{bucket}/{name}/*"] + [f"arn:aws:s3:::{bucket}"] * 2
    # the bucket itself: its location (s3fs's existence probe) and a listing of the prefix
    assert [st["Action"] for st in policy["Statement"][1:]] == ["s3:GetBucketLocation",
                                                               "s3:ListBucket"]
    assert policy["Statement"][2]["Condition"]["StringLike"]["s3:prefix"] == [f"{name}/*"]
    trust = iam.get_role(RoleName=f"spotctl-{name}-node")["Role"]["AssumeRolePolicyDocument"]
    assert "ec2.amazonaws.com" in json.dumps(trust)
    # A checkpoint written by a node survives `down`; the identity does not.
    s3.put_object(Bucket=bucket, Key=f"{name}/checkpoints/step-10/model.pt", Body=b"x")
    assert p.cleanup() == []
    assert s3.list_objects_v2(Bucket=bucket, Prefix=f"{name}/")["KeyCount"] == 1
    with pytest.raises(iam.exceptions.NoSuchEntityException):
        iam.get_instance_profile(InstanceProfileName=f"spotctl-{name}-node")
    with pytest.raises(iam.exceptions.NoSuchEntityException):
        iam.get_role(RoleName=f"spotctl-{name}-node")
    # Purge: the prefix's objects go too (another cluster's prefix is untouched).
    # (its own name: the bucket is the session's moto account's, shared with other tests,
    # e.g. test_down_purge's "other/" cluster when both run in one pytest-xdist worker)
    other = f"other-{name}"
    s3.put_object(Bucket=bucket, Key=f"{other}/checkpoints/keep", Body=b"y")
    purged = make_provider(name=name, options={"purge": True})
    assert purged.cleanup() == []
    assert s3.list_objects_v2(Bucket=bucket, Prefix=f"{name}/")["KeyCount"] == 0
    assert s3.list_objects_v2(Bucket=bucket, Prefix=f"{other}/")["KeyCount"] == 1


def test_given_bucket_must_exist_and_an_explicit_checkpoint_dir_wins(
    make_provider: MakeProvider, moto_url: str
) -> None:
    missing = make_provider(bucket="spotctl-test-nope")
    with pytest.raises(SpecError, match="aws.bucket: bucket spotctl-test-nope does not exist"):
        missing.prepare()
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=moto_url)
    s3.create_bucket(Bucket="spotctl-test-mine")
    p = make_provider(bucket="spotctl-test-mine")
    p.ctx.spec.train.checkpoint_dir = "s3://elsewhere/ckpt"
    p.prepare()
    assert p.ctx.spec.train.checkpoint_dir == "s3://elsewhere/ckpt"
    assert p.node_policy()["Statement"][0]["Resource"] == (
        f"arn:aws:s3:::spotctl-test-mine/{p.ctx.cluster}/*"
    )
    assert p.cleanup() == []
