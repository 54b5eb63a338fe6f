"""AWS provider, checkpoint storage and node identity: an S3 prefix per cluster, reachable
from the workers through an instance profile scoped to it.

This module owns where a cluster's checkpoints live on AWS and who may touch them: the
bucket (aws.bucket, else `spotctl-<account>-<region>`, created private on first use), the
cluster's prefix `<cluster>/` in it (its `checkpoints/` is the default train.checkpoint_dir
on AWS), and the IAM role + instance profile `spotctl-<cluster>-node` whose only permission
is that prefix. `down` deletes the role and profile and keeps the checkpoints; a purge
(ctx.options["purge"]) also deletes the objects under the prefix.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from spotctl.errors import ProviderError, SpecError
from spotctl.providers.aws import catalog as catalog_aws
from spotctl.providers.aws.api import TAG_CLUSTER, AwsApi, error_code
from spotctl.providers.base import ClusterCheckpoints

NODE_POLICY = "spotctl-checkpoints"
HEAD_POLICY = "spotctl-replace-nodes"
# What the head's reconcile loop reads: offers, prices, its cluster's instances, the network
# and image it launches into (EC2 has no resource-level permissions for these)
HEAD_DESCRIBES = (
    "ec2:DescribeInstances", "ec2:DescribeInstanceTypes", "ec2:DescribeSpotPriceHistory",
    "ec2:DescribeImages", "ec2:DescribeVpcs", "ec2:DescribeSubnets",
    "ec2:DescribeAvailabilityZones", "ec2:DescribeSecurityGroups", "ec2:DescribeKeyPairs",
    "ec2:DescribePlacementGroups", "ec2:DescribeAddresses",
)
_GONE = ("NoSuchEntity", "NoSuchBucket", "404", "NotFound")


class AwsStorage(ClusterCheckpoints, AwsApi):
    """Bucket, prefix and the workers' instance profile."""

    _account_id = ""

    if TYPE_CHECKING:  # the provider's other parts (network, offers, launch) give these
        def _vpc(self) -> tuple[str, bool]: ...
        def _wanted_types(self) -> list[str]: ...
        def _ami(self, role: str = "worker") -> str: ...
        def _image_owners(self, ami: str) -> list[str]: ...

    def _svc(self, name: str) -> Any:
        return self._session.client(name, **self._client_kwargs)

    def account_id(self) -> str:
        if not self._account_id:
            ident = self._call("who am I (sts)", self._svc("sts").get_caller_identity)
            self._account_id = str(ident["Account"])
        return self._account_id

    def bucket_name(self) -> str:
        return self.spec.bucket or f"spotctl-{self.account_id()}-{self.region}"

    @property
    def prefix(self) -> str:
        return f"{self.ctx.cluster}/"

    def checkpoint_uri(self) -> str:
        return f"s3://{self.bucket_name()}/{self.prefix}checkpoints"

    @property
    def node_profile(self) -> str:
        return f"spotctl-{self.ctx.cluster}-node"[:64]

    @property
    def head_profile(self) -> str:
        return f"spotctl-{self.ctx.cluster}-head"[:64]

    # ---- bucket -----------------------------------------------------------------------

    def bucket_exists(self) -> bool:
        try:
            self._call(
                f"look up bucket {self.bucket_name()}",
                self._svc("s3").head_bucket,
                Bucket=self.bucket_name(),
            )
            return True
        except ProviderError as e:
            if error_code(e) in _GONE:
                return False
            raise

    def _ensure_bucket(self) -> None:
        bucket = self.bucket_name()
        if self.bucket_exists():
            return
        if self.spec.bucket:
            raise SpecError(f"aws.bucket: bucket {bucket} does not exist (or is not yours)")
        s3 = self._svc("s3")
        kwargs: dict[str, Any] = {"Bucket": bucket}
        if self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        self._call(f"create bucket {bucket}", s3.create_bucket, **kwargs)
        self._call(
            f"block public access to {bucket}",
            s3.put_public_access_block,
            Bucket=bucket,
            PublicAccessBlockConfiguration={
                "BlockPublicAcls": True,
                "IgnorePublicAcls": True,
                "BlockPublicPolicy": True,
                "RestrictPublicBuckets": True,
            },
        )
        # a node preempted or killed mid-save leaves its multipart upload open, and its parts
        # are stored (and billed) until someone aborts it: S3 does so after a day
        self._call(
            f"expire unfinished uploads in {bucket}",
            s3.put_bucket_lifecycle_configuration,
            Bucket=bucket,
            LifecycleConfiguration={"Rules": [{
                "ID": "spotctl-abort-unfinished-uploads", "Status": "Enabled",
                "Filter": {"Prefix": ""},
                "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
            }]},
        )  # fmt: skip

    def purge_checkpoints(self) -> int:
        """Delete every object under the cluster's prefix; how many were deleted."""
        if not self.bucket_exists():
            return 0
        s3, bucket, n = self._svc("s3"), self.bucket_name(), 0
        token: str | None = None
        while True:
            page = self._call(
                f"list s3://{bucket}/{self.prefix}",
                s3.list_objects_v2,
                Bucket=bucket,
                Prefix=self.prefix,
                **({"ContinuationToken": token} if token else {}),
            )
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self._call(
                    f"delete {len(keys)} object(s) under s3://{bucket}/{self.prefix}",
                    s3.delete_objects,
                    Bucket=bucket,
                    Delete={"Objects": keys, "Quiet": True},
                )
                n += len(keys)
            token = page.get("NextContinuationToken")
            if not token:
                return n

    # ---- node identity ----------------------------------------------------------------

    def node_policy(self) -> dict[str, Any]:
        """The workers' only permission: read and write the cluster's prefix.

        s3fs's makedirs (spotctl's own, and DCP's writer before every save) first asks
        whether the bucket exists: HeadBucket, which needs s3:ListBucket without a prefix
        (not granted: it would list every cluster's keys), then GetBucketLocation. When
        both are refused it calls CreateBucket, and the save fails with AccessDenied; so
        GetBucketLocation on this bucket is granted, and nothing on any other bucket."""
        bucket = self.bucket_name()
        return {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    # (a save's multipart upload is s3:PutObject; aborting a failed one
                    # is an action of its own)
                    "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                               "s3:AbortMultipartUpload"],
                    "Resource": f"arn:aws:s3:::{bucket}/{self.prefix}*",
                },
                {
                    "Effect": "Allow",
                    "Action": "s3:GetBucketLocation",
                    "Resource": f"arn:aws:s3:::{bucket}",
                },
                {
                    "Effect": "Allow",
                    "Action": "s3:ListBucket",
                    "Resource": f"arn:aws:s3:::{bucket}",
                    "Condition": {"StringLike": {"s3:prefix": [f"{self.prefix}*"]}},
                },
            ],
        }

    def head_policy(self) -> dict[str, Any]:
        """The head's permissions ([rebalance] on_head): replace this cluster's lost
        workers and nothing else. It launches only instances and volumes tagged for this
        cluster, tags only while launching, terminates and reads the console of this
        cluster's instances only, and hands the workers' role (no other) to what it
        launches, and create this cluster's placement group in a zone it moves to (EFA
        types); where the account encrypts new volumes with its own KMS key, it may use
        the account's keys through EC2 in this region, as every launch then must. It
        cannot create or change security groups, key pairs, roles or buckets,
        and has no access to the checkpoints."""
        region, acct, name = self.region, self.account_id(), self.ctx.cluster
        ec2 = f"arn:aws:ec2:{region}:{acct}"
        own = {"StringEquals": {f"ec2:ResourceTag/{TAG_CLUSTER}": name}}
        vpc = {"StringEquals": {"ec2:Vpc": f"{ec2}:vpc/{self._vpc()[0]}"}}
        subnets = [f"{ec2}:subnet/{s}" for s in self.spec.subnet_ids] or [f"{ec2}:subnet/*"]
        # the workers' image: the pinned AMI, else whatever its SSM parameter names later
        # (a new release), but only from the owner of the one it names now
        image = ([f"arn:aws:ec2:{region}::image/{self.spec.ami}"] if self.spec.ami
                 else [f"arn:aws:ec2:{region}::image/*"])
        return {
            "Version": "2012-10-17",
            "Statement": [
                {"Sid": "See", "Effect": "Allow", "Action": list(HEAD_DESCRIBES),
                 "Resource": "*"},
                {"Sid": "LaunchOnlyTaggedForThisClusterOfItsTypes", "Effect": "Allow",
                 "Action": "ec2:RunInstances", "Resource": f"{ec2}:instance/*",
                 "Condition": self._head_types({f"aws:RequestTag/{TAG_CLUSTER}": name})},
                {"Sid": "VolumesTaggedForThisCluster", "Effect": "Allow",
                 "Action": "ec2:RunInstances", "Resource": f"{ec2}:volume/*",
                 "Condition": {"StringEquals": {f"aws:RequestTag/{TAG_CLUSTER}": name}}},
                {"Sid": "LaunchIntoThisClustersGroupAndKey", "Effect": "Allow",
                 "Action": "ec2:RunInstances",
                 "Resource": [f"{ec2}:security-group/*", f"{ec2}:key-pair/*",
                              f"{ec2}:placement-group/*"],
                 "Condition": own},
                {"Sid": "LaunchOnlyTheWorkersImage", "Effect": "Allow",
                 "Action": "ec2:RunInstances", "Resource": image,
                 "Condition": {"StringEquals": {
                     "ec2:Owner": self._image_owners(self._ami("worker"))}}},
                {"Sid": "LaunchOnlyIntoThisClustersVpc", "Effect": "Allow",
                 "Action": "ec2:RunInstances",
                 "Resource": [*subnets, f"{ec2}:network-interface/*"], "Condition": vpc},
                {"Sid": "SpotRequests", "Effect": "Allow", "Action": "ec2:RunInstances",
                 "Resource": f"{ec2}:spot-instances-request/*"},
                # an EFA type in a zone the cluster had no nodes in yet (a move)
                {"Sid": "PlacementGroupsOfThisCluster", "Effect": "Allow",
                 "Action": "ec2:CreatePlacementGroup",
                 "Resource": f"{ec2}:placement-group/spotctl-{name}-*",
                 "Condition": {"StringEquals": {f"aws:RequestTag/{TAG_CLUSTER}": name}}},
                # a replacement with several EFA interfaces gets one of the cluster's
                # Elastic IPs (efa.py): a free one, else a new one tagged for the cluster
                {"Sid": "ElasticIpsOfThisCluster", "Effect": "Allow",
                 "Action": "ec2:AllocateAddress", "Resource": f"{ec2}:elastic-ip/*",
                 "Condition": {"StringEquals": {f"aws:RequestTag/{TAG_CLUSTER}": name}}},
                {"Sid": "AssociateOnlyThisClustersElasticIps", "Effect": "Allow",
                 "Action": "ec2:AssociateAddress", "Resource": f"{ec2}:elastic-ip/*",
                 "Condition": own},
                {"Sid": "AssociateWithAnInterface", "Effect": "Allow",
                 "Action": "ec2:AssociateAddress", "Resource": f"{ec2}:network-interface/*"},
                {"Sid": "TagOnlyWhileCreating", "Effect": "Allow", "Action": "ec2:CreateTags",
                 "Resource": "*",
                 "Condition": {"StringEquals": {
                     "ec2:CreateAction": ["RunInstances", "CreatePlacementGroup",
                                          "AllocateAddress"]}}},
                {"Sid": "EndAndReadOnlyThisClustersInstances", "Effect": "Allow",
                 "Action": ["ec2:TerminateInstances", "ec2:GetConsoleOutput"],
                 "Resource": f"{ec2}:instance/*", "Condition": own},
                {"Sid": "GiveWorkersTheirRole", "Effect": "Allow", "Action": "iam:PassRole",
                 "Resource": f"arn:aws:iam::{acct}:role/{self.node_profile}",
                 "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}},
                # EBS encryption by default with a customer-managed key (an account
                # setting): EC2 encrypts a launch's volumes with it on the caller's behalf,
                # so the caller needs these on the key; only through EC2 in this region
                {"Sid": "EncryptedVolumesThroughEC2", "Effect": "Allow",
                 "Action": ["kms:Decrypt", "kms:DescribeKey",
                            "kms:GenerateDataKeyWithoutPlaintext", "kms:ReEncryptFrom",
                            "kms:ReEncryptTo"],
                 "Resource": f"arn:aws:kms:{region}:{acct}:key/*",
                 "Condition": {"StringEquals": {"kms:ViaService": f"ec2.{region}.amazonaws.com"}}},
                {"Sid": "EncryptedVolumesGrantToEC2", "Effect": "Allow",
                 "Action": "kms:CreateGrant", "Resource": f"arn:aws:kms:{region}:{acct}:key/*",
                 "Condition": {"StringEquals": {"kms:ViaService": f"ec2.{region}.amazonaws.com"},
                               "Bool": {"kms:GrantIsForAWSResource": "true"}}},
                {"Sid": "ImageNames", "Effect": "Allow", "Action": "ssm:GetParameter",
                 "Resource": [f"arn:aws:ssm:{region}::parameter/aws/service/*",
                              *self._own_image_parameter(region, acct)]},
            ],
        }  # fmt: skip

    def _head_types(self, equals: dict[str, Any]) -> dict[str, Any]:
        """`equals` and the instance types the head may launch: the cluster's, or where the
        catalog has none for the region (offers then need aws.instance_types), its GPU
        families."""
        try:
            return {"StringEquals": {**equals, "ec2:InstanceType": self._wanted_types()}}
        except SpecError:
            families = sorted({t.split(".")[0] for t in catalog_aws.instance_types()})
            return {"StringEquals": equals,
                    "StringLike": {"ec2:InstanceType": [f"{f}.*" for f in families]}}

    def _own_image_parameter(self, region: str, acct: str) -> list[str]:
        """The workers' image parameter when it is the user's own (not one of AWS's public
        ones under /aws/service/): the head looks it up for every launch."""
        name = "" if self.spec.ami else self.spec.ami_ssm_parameter
        if not name or name.startswith("/aws/service/"):
            return []
        if name.startswith("arn:"):
            return [name]
        return [f"arn:aws:ssm:{region}:{acct}:parameter/{name.lstrip('/')}"]

    def _ensure_node_identity(self) -> None:
        self._ensure_identity(self.node_profile, NODE_POLICY, self.node_policy(),
                              "workers' checkpoints")

    def _ensure_head_identity(self) -> None:
        self._ensure_identity(self.head_profile, HEAD_POLICY, self.head_policy(),
                              "the head replaces lost workers")

    def _ensure_identity(self, name: str, policy_name: str, policy: dict[str, Any],
                         purpose: str) -> None:
        """Role `name` for EC2 with this one inline policy, and its instance profile."""
        iam = self._svc("iam")
        trust = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": {"Service": "ec2.amazonaws.com"},
                    "Action": "sts:AssumeRole",
                }
            ],
        }
        try:
            self._call(f"look up role {name}", iam.get_role, RoleName=name)
        except ProviderError as e:
            if error_code(e) != "NoSuchEntity":
                raise
            self._call(
                f"create role {name}",
                iam.create_role,
                RoleName=name,
                AssumeRolePolicyDocument=json.dumps(trust),
                Description=f"spotctl cluster {self.ctx.cluster}: {purpose}",
                Tags=[{"Key": TAG_CLUSTER, "Value": self.ctx.cluster}],
            )
        # Put every time: reconciled if the bucket or the policy changed.
        self._call(
            f"set the policy of role {name} ({purpose})",
            iam.put_role_policy,
            RoleName=name,
            PolicyName=policy_name,
            PolicyDocument=json.dumps(policy),
        )
        try:
            prof = self._call(
                f"look up instance profile {name}",
                iam.get_instance_profile,
                InstanceProfileName=name,
            )["InstanceProfile"]
        except ProviderError as e:
            if error_code(e) != "NoSuchEntity":
                raise
            prof = self._call(
                f"create instance profile {name}",
                iam.create_instance_profile,
                InstanceProfileName=name,
                Tags=[{"Key": TAG_CLUSTER, "Value": self.ctx.cluster}],
            )["InstanceProfile"]
        if not any(r.get("RoleName") == name for r in prof.get("Roles", [])):
            self._call(
                f"add role {name} to its instance profile",
                iam.add_role_to_instance_profile,
                InstanceProfileName=name,
                RoleName=name,
            )

    def _delete_node_identity(self) -> list[str]:
        """Remove the workers' and the head's roles and instance profiles; leaks as lines."""
        return (self._delete_identity(self.node_profile, NODE_POLICY)
                + self._delete_identity(self.head_profile, HEAD_POLICY))

    def _delete_identity(self, name: str, policy_name: str) -> list[str]:
        iam, leaks = self._svc("iam"), []
        steps: list[tuple[str, Any, dict[str, Any]]] = [
            ("detach role from profile", iam.remove_role_from_instance_profile,
             {"InstanceProfileName": name, "RoleName": name}),
            ("delete instance profile", iam.delete_instance_profile, {"InstanceProfileName": name}),
            ("delete role policy", iam.delete_role_policy,
             {"RoleName": name, "PolicyName": policy_name}),
            ("delete role", iam.delete_role, {"RoleName": name}),
        ]  # fmt: skip
        for what, fn, kwargs in steps:
            try:
                self._call(f"{what} {name}", fn, **kwargs)
            except ProviderError as e:
                if error_code(e) not in _GONE:
                    leaks.append(f"{what} {name}: {e}")
        return leaks

    def _wait_profile_usable(self, attempt: int) -> bool:
        """IAM is eventually consistent: a just-made profile can be unknown to EC2 for a
        few seconds. True when a retry is worth it."""
        if attempt >= 10:
            return False
        time.sleep(min(5.0, self._retry.base_s * 2**attempt))
        return True
