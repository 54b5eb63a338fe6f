"""A worker's checkpoint I/O with the node's own credentials, IAM enforced.

`prepare_storage` (what `up` runs) creates the bucket and the role `spotctl-<cluster>-node`
with its policy; the test assumes that role through STS (as EC2 does for the instance
profile), turns moto's IAM enforcement on, and runs the real checkpoint path with those
credentials: spotctl's Checkpointer over s3fs and torch.distributed.checkpoint saves a
small state, writes COMMIT and loads it back.

s3fs's makedirs (spotctl's own `prepare`, DCP's writer) probes the bucket with HeadBucket,
then GetBucketLocation, and creates the bucket when both are refused; a policy without
GetBucketLocation made that CreateBucket fail with AccessDenied on the first checkpoint.

What moto's enforcement checks and what it does not (moto 5.2): actions and resources,
per principal; it maps HeadBucket to an action of its own (`s3:HeadBucket`, which no
policy grants; AWS checks s3:ListBucket without an s3:prefix, which the node's conditioned
ListBucket does not grant either); it ignores StringLike conditions, so the s3:prefix
scope of ListBucket is not exercised here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import boto3
import pytest
import requests

from spotctl.providers.aws.provider import AwsProvider

from .conftest import REGION

torch = pytest.importorskip("torch")
pytest.importorskip("s3fs")
from tests.elastic.harness import single_rank_group  # noqa: E402

pytestmark = pytest.mark.aws


@contextmanager
def iam_enforced(moto_url: str) -> Iterator[None]:
    """moto authenticates and authorizes every request from here on (process-wide: the
    setting is moto's module state), and stops when the block ends."""
    requests.post(f"{moto_url}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
    try:
        yield
    finally:
        requests.post(f"{moto_url}/moto-api/reset-auth", data=b"inf", timeout=10)


def _assume_node_role(moto_url: str, role: str) -> dict[str, str]:
    sts = boto3.client("sts", region_name=REGION, endpoint_url=moto_url)
    arn = boto3.client("iam", region_name=REGION, endpoint_url=moto_url).get_role(
        RoleName=role)["Role"]["Arn"]  # fmt: skip
    creds = sts.assume_role(RoleArn=arn, RoleSessionName="i-node")["Credentials"]
    return {"AWS_ACCESS_KEY_ID": creds["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
            "AWS_SESSION_TOKEN": creds["SessionToken"]}  # fmt: skip


def test_node_role_saves_commits_and_loads_a_checkpoint_under_iam(
    make_provider: Callable[..., AwsProvider], moto_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from spotctl.elastic.checkpoint import Checkpointer, open_store

    p = make_provider()
    p.prepare_storage()
    root = p.ctx.spec.train.checkpoint_dir
    bucket = p.bucket_name()
    assert root == f"s3://{bucket}/{p.ctx.cluster}/checkpoints"
    node_env = _assume_node_role(moto_url, p.node_profile)
    # the worker's environment: the instance profile's credentials and nothing else
    for k, v in node_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SPOTCTL_CHECKPOINT_STORAGE_OPTIONS", raising=False)
    # parts of 5 MiB: the 6.25 MiB tensor's file goes up as a multipart upload
    monkeypatch.setenv("SPOTCTL_CHECKPOINT_PART_MB", "5")
    state = {"model": {"w": torch.full((1600, 1024), 3.0), "b": torch.arange(4.0)}}
    with iam_enforced(moto_url), single_rank_group() as pg:
        ck = Checkpointer(root, keep_last=2, rank=0, pg=pg, mode="thread")
        assert ck.save_sync(10, state, {"epoch": 0, "offset": 40})
        ck.close()
        assert open_store(root).committed(10)
        fresh = {"model": {"w": torch.zeros(1600, 1024), "b": torch.zeros(4)}}
        again = Checkpointer(root, keep_last=2, rank=0, pg=pg, mode="thread")
        meta = again.load_latest(fresh)
        again.close()
        assert meta is not None and meta["step"] == 10 and meta["offset"] == 40
        assert torch.equal(fresh["model"]["w"], state["model"]["w"])
        assert torch.equal(fresh["model"]["b"], state["model"]["b"])
        # the node reaches only its cluster's prefix: no other prefix, no other bucket
        s3 = boto3.client("s3", region_name=REGION, endpoint_url=moto_url,
                          aws_access_key_id=node_env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=node_env["AWS_SECRET_ACCESS_KEY"],
                          aws_session_token=node_env["AWS_SESSION_TOKEN"])  # fmt: skip
        # a failed save aborts its multipart upload (no parts left stored and billed)
        up = s3.create_multipart_upload(Bucket=bucket, Key=f"{p.ctx.cluster}/checkpoints/y")
        s3.abort_multipart_upload(Bucket=bucket, Key=f"{p.ctx.cluster}/checkpoints/y",
                                  UploadId=up["UploadId"])
        for call, kwargs in (
            (s3.put_object, {"Bucket": bucket, "Key": f"other-{p.ctx.cluster}/x", "Body": b"x"}),
            (s3.get_object, {"Bucket": bucket, "Key": f"other-{p.ctx.cluster}/x"}),
            (s3.create_bucket, {"Bucket": f"{bucket}-other"}),
        ):
            with pytest.raises(s3.exceptions.ClientError, match="AccessDenied"):
                call(**kwargs)
    # the policy is the one `up` put on the role
    iam = boto3.client("iam", region_name=REGION, endpoint_url=moto_url)
    doc = iam.get_role_policy(RoleName=p.node_profile, PolicyName="spotctl-checkpoints")
    policy = doc["PolicyDocument"]
    assert (json.loads(policy) if isinstance(policy, str) else policy) == p.node_policy()
    assert p.cleanup() == []
