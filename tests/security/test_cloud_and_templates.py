"""Issue 9, security in the clouds and the shipped policies, checked by behaviour: the
providers run against moto in server mode (AWS) and the fake Compute REST server (GCP),
and what they created there is asserted; the policies are read from the wheel spotctl
really builds.

- AWS launches require IMDSv2 with hop limit 1 (workers and head).
- AWS security group: SSH only from the user's CIDR, cluster ports only from the group.
- ssh_cidr comes from the spec or the caller, or `prepare` fails with a clear error.
- GCP firewall: SSH only from the user's CIDR, internal rule by tag with no source range.
- The IAM policy and GCP role list are least-privilege, and ship in the wheel.
More of the same lives next to the fakes (tests/aws/test_provider.py,
tests/gcp/test_provider.py); the IAM policy against a whole lifecycle's calls in
tests/aws/test_iam_policy.py; SSH host-key pinning in tests/ssh/test_bootstrap.py.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spotctl.errors import SpecError
from spotctl.providers.aws.api import COORDINATOR_PORT, STORE_PORT, TAG_CLUSTER
from spotctl.providers.gcp.provider import GcpProvider
from spotctl.remote.package import spotctl_wheel
from tests.aws.conftest import ami, ec2, make_provider, moto_url  # noqa: F401 - fixtures
from tests.gcp.conftest import CIDR, fake, make_ctx  # noqa: F401 - fixtures

MakeProvider = Callable[..., Any]


def _instances(ec2: Any, ids: list[str]) -> list[dict[str, Any]]:  # noqa: F811 - the fixture
    res = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    return [i for r in res for i in r["Instances"]]


@pytest.mark.aws
def test_aws_workers_and_head_require_imdsv2_hop_limit_1(
    make_provider: MakeProvider, ec2: Any  # noqa: F811
) -> None:
    p = make_provider(instance_types=["g5.xlarge"])
    offer = next(o for o in p.offers() if o.instance_type == "g5.xlarge")
    workers = p.launch(offer, 1, "req-imds")
    head = p.ensure_head()
    raw = _instances(ec2, [workers[0].id, head.instance_id])
    assert len(raw) == 2
    for inst in raw:
        assert inst["MetadataOptions"]["HttpTokens"] == "required", inst["MetadataOptions"]
        assert inst["MetadataOptions"]["HttpPutResponseHopLimit"] == 1, inst["MetadataOptions"]


@pytest.mark.aws
def test_aws_security_group_ssh_from_cidr_cluster_ports_from_group(
    make_provider: MakeProvider, ec2: Any  # noqa: F811
) -> None:
    p = make_provider(ssh_cidr="203.0.113.9/32")
    p.prepare()
    (group,) = ec2.describe_security_groups(
        Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [p.ctx.cluster]}]
    )["SecurityGroups"]
    perms = group["IpPermissions"]
    by_cidr = [r for r in perms if r.get("IpRanges") or r.get("Ipv6Ranges")]
    assert [(r["IpProtocol"], r["FromPort"], r["ToPort"]) for r in by_cidr] == [("tcp", 22, 22)]
    assert [x["CidrIp"] for x in by_cidr[0]["IpRanges"]] == ["203.0.113.9/32"]
    assert not by_cidr[0].get("Ipv6Ranges")
    for port in (COORDINATOR_PORT, STORE_PORT):
        reaching = [r for r in perms
                    if r["IpProtocol"] == "-1" or r.get("FromPort", 0) <= port <= r.get("ToPort", -1)]
        assert reaching, port
        for r in reaching:
            assert [g["GroupId"] for g in r["UserIdGroupPairs"]] == [group["GroupId"]]
            assert not r.get("IpRanges") and not r.get("Ipv6Ranges")


@pytest.mark.aws
def test_aws_ssh_cidr_from_caller_or_a_clear_error(
    make_provider: MakeProvider, ec2: Any  # noqa: F811
) -> None:
    p = make_provider(ssh_cidr="", options={"ssh_cidr": "192.0.2.44"})
    p.prepare()
    (group,) = ec2.describe_security_groups(
        Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [p.ctx.cluster]}]
    )["SecurityGroups"]
    assert [x["CidrIp"] for r in group["IpPermissions"] for x in r.get("IpRanges", [])] == [
        "192.0.2.44/32"
    ]
    with pytest.raises(SpecError, match="aws.ssh_cidr"):
        make_provider(ssh_cidr="").prepare()


def test_gcp_firewall_ssh_from_cidr_internal_by_account(fake: Any, spotctl_home: Path) -> None:  # noqa: F811
    GcpProvider(make_ctx(fake, spotctl_home)).prepare()
    rules = list(fake.firewalls.values())
    allowing = [r for r in rules if r.get("allowed")]
    with_ranges = [r for r in allowing if r.get("sourceRanges")]
    # the only rule that admits addresses is SSH (tcp/22) from the user's CIDR
    assert len(with_ranges) == 1
    (ssh,) = with_ranges
    assert ssh["sourceRanges"] == [CIDR]
    assert ssh["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]
    internal = [r for r in allowing if r is not ssh]
    assert internal, rules
    for r in internal:
        assert "sourceRanges" not in r, r
        assert r["sourceServiceAccounts"] == r["targetServiceAccounts"], r
        assert not r.get("sourceTags") and not r.get("targetTags"), r
    # whatever else reaches the members is denied
    assert any(r.get("denied") == [{"IPProtocol": "all"}] for r in rules)


def test_gcp_without_ssh_cidr_is_a_spec_error(fake: Any, spotctl_home: Path) -> None:  # noqa: F811
    with pytest.raises(SpecError, match="gcp.ssh_cidr"):
        GcpProvider(make_ctx(fake, spotctl_home, ssh_cidr="")).prepare()
    assert fake.firewalls == {}


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """What the wheel spotctl builds for itself (and ships to nodes) contains."""
    whl = spotctl_wheel(tmp_path_factory.mktemp("wheel-cache"))
    with zipfile.ZipFile(whl) as z:
        return {n: z.read(n) for n in z.namelist()}


def _shipped(wheel_files: dict[str, bytes], name: str) -> bytes:
    hits = [n for n in wheel_files if n.endswith(f"templates/{name}")]
    assert hits, f"templates/{name} is not in the wheel"
    return wheel_files[hits[0]]


def test_iam_policy_is_least_privilege(wheel_files: dict[str, bytes]) -> None:
    doc = json.loads(_shipped(wheel_files, "aws-iam-policy.json"))
    assert doc["Version"] == "2012-10-17"
    actions = []
    for st in doc["Statement"]:
        assert st["Effect"] == "Allow"
        acts = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        actions += acts
        for a in acts:
            assert "*" not in a, f"wildcard action {a}"
        assert not st.get("NotAction") and not st.get("NotResource")
        # mutating calls are scoped: by resource type or by the cluster tag
        if any(
            a.split(":")[1].startswith(("Run", "Create", "Terminate", "Delete", "Authorize"))
            for a in acts
        ):
            assert st["Resource"] != "*" or st.get("Condition"), st
    assert {"ec2:RunInstances", "ec2:TerminateInstances"} <= set(actions)
    # IAM: the Spot service-linked role on a first spot launch, the workers' checkpoint
    # role/profile and the head's, by name (spotctl-*-node, spotctl-*-head); PassRole only
    # of those roles, only to EC2
    iam = [
        st
        for st in doc["Statement"]
        if any(
            a.startswith("iam:")
            for a in (st["Action"] if isinstance(st["Action"], list) else [st["Action"]])
        )
    ]
    for st in iam:
        resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        if st["Action"] in ("iam:CreateServiceLinkedRole", ["iam:CreateServiceLinkedRole"]):
            assert "AWSServiceRoleForEC2Spot" in json.dumps(resources), st
            continue
        assert all(r.endswith(("role/spotctl-*-node", "instance-profile/spotctl-*-node",
                               "role/spotctl-*-head", "instance-profile/spotctl-*-head"))
                   for r in resources), st  # fmt: skip
        if "iam:PassRole" in json.dumps(st["Action"]):
            assert st["Action"] in ("iam:PassRole", ["iam:PassRole"]), st
            assert st["Condition"]["StringEquals"]["iam:PassedToService"] == "ec2.amazonaws.com"
    # S3: only buckets named spotctl-*
    for st in doc["Statement"]:
        acts = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        if any(a.startswith("s3:") for a in acts):
            assert all(r.startswith("arn:aws:s3:::spotctl-") for r in st["Resource"]), st


def test_gcp_role_list_is_least_privilege(wheel_files: dict[str, bytes]) -> None:
    text = _shipped(wheel_files, "gcp-roles.txt").decode()
    lines = [ln.strip() for ln in text.splitlines()]
    perms = [ln for ln in lines if ln and not ln.startswith("#")]
    assert "compute.instances.create" in perms and "compute.instances.delete" in perms
    # the head's project bindings ([rebalance] on_head): the project's policy, read and
    # written, and nothing else of the resource manager
    assert [p for p in perms if p.startswith("resourcemanager.")] == [
        "resourcemanager.projects.getIamPolicy", "resourcemanager.projects.setIamPolicy"]
    # whether the organization enforces OS Login: one read, nothing else of its policies
    assert [p for p in perms if p.startswith("orgpolicy.")] == ["orgpolicy.policy.get"]
    # the head's custom role: made, read, brought back, kept in step; never deleted
    assert [p for p in perms if p.startswith("iam.roles.")] == [
        "iam.roles.create", "iam.roles.get", "iam.roles.update", "iam.roles.undelete"]
    # no network tags (the firewall rules pick members by service account)
    assert "compute.instances.setTags" not in perms
    for p in perms:
        # VMs and firewalls; the checkpoint bucket; the workers' and the head's accounts
        assert p.startswith(("compute.", "storage.", "iam.serviceAccounts.", "iam.roles.",
                             "resourcemanager.projects.", "orgpolicy.policy.get")), p
        assert "*" not in p, p
        assert not p.startswith("roles/"), "a broad predefined role in the list"
    assert len(perms) == len(set(perms))


def test_templates_ship_in_the_wheel(wheel_files: dict[str, bytes]) -> None:
    # what nodes are rendered from and the policies users are pointed at, byte for byte
    repo = Path(__file__).resolve().parents[2] / "templates"
    for src in sorted(repo.iterdir()):
        if src.is_file():
            assert _shipped(wheel_files, src.name) == src.read_bytes(), src.name
