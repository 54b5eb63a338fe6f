"""AwsProvider against moto in server mode (real HTTP, real botocore)."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spotctl.control.planner import Observed, plan
from spotctl.errors import SpecError
from spotctl.providers.aws import catalog as catalog_aws
from spotctl.providers.aws.api import (
    COORDINATOR_PORT,
    STORE_PORT,
    TAG_CLUSTER,
    TAG_REQUEST,
    TAG_ROLE,
)
from spotctl.providers.aws.provider import AwsProvider
from spotctl.providers.base import Provider
from spotctl.remote.bootstrap import LIGHTHOUSE_PORT

pytestmark = pytest.mark.aws

TYPES = ["g5.xlarge", "p4d.24xlarge", "t3.micro"]
MakeProvider = Callable[..., AwsProvider]


def _tags(inst: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in inst.get("Tags", [])}


def _instances(ec2: Any, ids: list[str]) -> list[dict[str, Any]]:
    res = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    return [i for r in res for i in r["Instances"]]


def _offer(p: AwsProvider, itype: str = "g5.xlarge", zone: str = "us-east-1a") -> Any:
    return next(o for o in p.offers() if o.instance_type == itype and o.zone == zone)


def test_offers_are_gpu_types_with_live_spot_and_catalog_on_demand(
    make_provider: MakeProvider,
) -> None:
    p = make_provider(instance_types=TYPES)
    assert isinstance(p, Provider)
    offers = p.offers()
    assert {o.instance_type for o in offers} == {"g5.xlarge", "p4d.24xlarge"}  # t3: no GPU
    assert all(o.zone.startswith("us-east-1") and o.region == "us-east-1" for o in offers)
    g5 = [o for o in offers if o.instance_type == "g5.xlarge"]
    assert {(o.gpus, o.gpu_name) for o in g5} == {(1, "A10G")}
    assert {o.spot_price for o in g5} == {0.00001}  # moto's spot price history
    assert {o.on_demand_price for o in g5} == {
        catalog_aws.on_demand_price("g5.xlarge", "us-east-1")
    }
    assert {o.interruption_band for o in g5} == {
        catalog_aws.interruption_band("g5.xlarge", "us-east-1")
    }
    p4d = [o for o in offers if o.instance_type == "p4d.24xlarge"]
    assert {(o.gpus, o.gpu_name, o.gpu_memory_gib) for o in p4d} == {(8, "A100", 40.0)}


def test_offers_filter_by_gpu_and_zone(make_provider: MakeProvider) -> None:
    by_gpu = make_provider(instance_types=TYPES, gpu="a10g").offers()
    assert by_gpu and {o.instance_type for o in by_gpu} == {"g5.xlarge"}
    by_zone = make_provider(instance_types=TYPES, zones=["us-east-1b"]).offers()
    assert by_zone and {o.zone for o in by_zone} == {"us-east-1b"}


def test_default_types_come_from_the_catalog_and_skip_retired_ones(
    make_provider: MakeProvider,
) -> None:
    offers = make_provider().offers()
    types = {o.instance_type for o in offers}
    assert types <= set(catalog_aws.instance_types("us-east-1"))
    assert {"g4dn.xlarge", "g5.xlarge", "p4d.24xlarge"} <= types
    assert not any(t.startswith("p3.") for t in types)  # moto (like AWS) retired p3


def test_a_named_p3_with_the_default_image_is_a_spec_error(make_provider: MakeProvider) -> None:
    with pytest.raises(SpecError, match=r"aws.instance_types: p3.2xlarge cannot run the "
                                        r"default Deep Learning AMI"):
        make_provider(ami="", instance_types=["g5.xlarge", "p3.2xlarge"]).offers()


def test_unknown_named_instance_type_is_a_spec_error(make_provider: MakeProvider) -> None:
    with pytest.raises(SpecError, match=r"aws.instance_types: .*nope\.xlarge"):
        make_provider(instance_types=["g5.xlarge", "nope.xlarge"]).offers()


def test_plan_over_aws_offers(make_provider: MakeProvider) -> None:
    p = make_provider(instance_types=["g5.xlarge", "g5.12xlarge", "p4d.24xlarge"])
    spec = type(p.ctx.spec).model_validate({**p.ctx.spec.model_dump(), "gpus": "8..16"})
    result = plan(spec, Observed(), p.offers(), {}, now=0.0)
    launches = result.to_json()["actions"]
    assert launches and all(a["type"] == "launch" for a in launches)
    first = launches[0]
    assert first["provider"] == "aws" and first["zone"].startswith("us-east-1")
    assert first["gpus"] * first["count"] >= 8
    assert first["price"] == 0.00001


def test_launch_tags_imdsv2_spot_and_cluster_resources(
    make_provider: MakeProvider, ec2: Any
) -> None:
    p = make_provider(instance_types=TYPES)
    offer = _offer(p)
    got = p.launch(offer, 2, "req-1")
    assert len(got) == 2 and {i.zone for i in got} == {"us-east-1a"}
    raw = _instances(ec2, [i.id for i in got])
    for inst in raw:
        tags = _tags(inst)
        assert tags[TAG_CLUSTER] == p.ctx.cluster
        assert tags[TAG_ROLE] == "worker"
        assert tags[TAG_REQUEST] == "req-1"
        assert inst["MetadataOptions"]["HttpTokens"] == "required"
        assert inst["MetadataOptions"]["HttpPutResponseHopLimit"] == 1
        assert inst["InstanceLifecycle"] == "spot"
        assert inst["KeyName"] == p.key_name
        assert inst["InstanceType"] == "g5.xlarge"
        assert inst["Placement"]["AvailabilityZone"] == "us-east-1a"
    groups = {g["GroupId"] for inst in raw for g in inst["SecurityGroups"]}
    assert len(groups) == 1
    key = p.key_path
    assert key.read_text().startswith("-----BEGIN")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    listed = {i.id: i for i in p.list(p.ctx.cluster)}
    assert set(listed) == {i.id for i in got}
    one = listed[got[0].id]
    assert (one.gpus, one.price, one.request_id, one.spot) == (1, 0.00001, "req-1", True)
    assert one.address and one.ssh_user == "ubuntu"


def test_launch_is_idempotent_by_request_id(make_provider: MakeProvider) -> None:
    p = make_provider(instance_types=TYPES)
    offer = _offer(p)
    first = p.launch(offer, 2, "req-same")
    again = p.launch(offer, 2, "req-same")
    assert sorted(i.id for i in again) == sorted(i.id for i in first)
    # Even when retried on another offer (after a failover), nothing is launched twice.
    other = p.launch(_offer(p, zone="us-east-1b"), 2, "req-same")
    assert sorted(i.id for i in other) == sorted(i.id for i in first)
    assert len(p.list(p.ctx.cluster)) == 2
    more = p.launch(offer, 1, "req-other")
    assert len(more) == 1 and len(p.list(p.ctx.cluster)) == 3


def test_security_group_rules(make_provider: MakeProvider, ec2: Any) -> None:
    p = make_provider(instance_types=TYPES, ssh_cidr="203.0.113.9/32")
    p.prepare()
    p.prepare()  # idempotent: still one group
    groups = ec2.describe_security_groups(
        Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [p.ctx.cluster]}]
    )["SecurityGroups"]
    assert len(groups) == 1
    group = groups[0]
    gid = group["GroupId"]
    cidr_rules = [r for r in group["IpPermissions"] if r.get("IpRanges")]
    assert [(r["IpProtocol"], r["FromPort"], r["ToPort"]) for r in cidr_rules] == [("tcp", 22, 22)]
    assert [x["CidrIp"] for x in cidr_rules[0]["IpRanges"]] == ["203.0.113.9/32"]
    assert not any(r.get("Ipv6Ranges") for r in group["IpPermissions"])
    group_rules = [r for r in group["IpPermissions"] if r.get("UserIdGroupPairs")]
    assert group_rules
    for r in group_rules:
        assert [pair["GroupId"] for pair in r["UserIdGroupPairs"]] == [gid]
        assert not r.get("IpRanges")
    # The coordinator and store ports, and torchft's Lighthouse (engine torchft), are
    # covered by a group rule, and by nothing else.
    for port in (COORDINATOR_PORT, STORE_PORT, LIGHTHOUSE_PORT):
        reaching = [
            r
            for r in group["IpPermissions"]
            if r["IpProtocol"] == "-1" or r.get("FromPort", 0) <= port <= r.get("ToPort", -1)
        ]
        assert reaching and all(
            r.get("UserIdGroupPairs") and not r.get("IpRanges") for r in reaching
        )


def test_ssh_cidr_from_caller_option_or_a_clear_error(
    make_provider: MakeProvider, ec2: Any
) -> None:
    p = make_provider(ssh_cidr="", options={"ssh_cidr": "192.0.2.44"})
    p.prepare()
    group = ec2.describe_security_groups(
        Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [p.ctx.cluster]}]
    )["SecurityGroups"][0]
    assert [x["CidrIp"] for r in group["IpPermissions"] for x in r.get("IpRanges", [])] == [
        "192.0.2.44/32"
    ]
    with pytest.raises(SpecError, match="aws.ssh_cidr: not set"):
        make_provider(ssh_cidr="").prepare()
    # (the spec refuses it as it is read: pydantic's ValidationError is a ValueError)
    with pytest.raises((SpecError, ValueError), match="not an IP address"):
        make_provider(ssh_cidr="my-laptop").prepare()


def test_the_ssh_rule_follows_a_changed_address(make_provider: MakeProvider, ec2: Any) -> None:
    """`up` refills an unset ssh_cidr with the controller's address on every run: the
    existing group's SSH rule moves to the new one, the old is revoked."""

    def ssh_sources() -> list[str]:
        group = ec2.describe_security_groups(
            Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [name]}]
        )["SecurityGroups"][0]
        return sorted(x.get("CidrIp") or x["CidrIpv6"] for r in group["IpPermissions"]
                      if r.get("FromPort") == 22
                      for x in r.get("IpRanges", []) + r.get("Ipv6Ranges", []))  # fmt: skip

    p = make_provider(ssh_cidr="203.0.113.9/32")
    name = p.ctx.cluster
    p.prepare()
    up = {"follow_ssh_cidr": True}  # what `up` passes (cmd_up.py)
    make_provider(name=name, ssh_cidr="198.51.100.3/32", options=up).prepare()
    assert ssh_sources() == ["198.51.100.3/32"]
    make_provider(name=name, ssh_cidr="2001:db8::7/128", options=up).prepare()
    assert ssh_sources() == ["2001:db8::7/128"]
    # no address known, or not `up` (a head's rebalance with an older spec): left as it is
    make_provider(name=name, ssh_cidr="", options=up).prepare()
    make_provider(name=name, ssh_cidr="203.0.113.9/32").prepare()
    assert ssh_sources() == ["2001:db8::7/128"]


def test_list_excludes_terminated_and_terminate_ignores_gone_and_foreign_ids(
    make_provider: MakeProvider, ec2: Any
) -> None:
    p = make_provider(instance_types=TYPES)
    a, b = p.launch(_offer(p), 2, "req-t")
    neighbour = make_provider(instance_types=TYPES)
    (theirs,) = neighbour.launch(_offer(neighbour), 1, "req-n")
    p.terminate([a.id])
    assert {i.id for i in p.list(p.ctx.cluster)} == {b.id}
    p.terminate([a.id, "i-0123456789abcdef0", theirs.id])  # gone, unknown, foreign: no-op
    p.terminate([])
    assert {i.id for i in p.list(p.ctx.cluster)} == {b.id}
    assert [i.id for i in neighbour.list(neighbour.ctx.cluster)] == [theirs.id]
    assert _instances(ec2, [a.id])[0]["State"]["Name"] == "terminated"


def test_head_is_on_demand_tagged_and_idempotent(make_provider: MakeProvider, ec2: Any) -> None:
    p = make_provider(instance_types=TYPES)
    head = p.ensure_head()
    assert head.store_port == STORE_PORT and head.url.endswith(f":{COORDINATOR_PORT}")
    assert head.store_host and head.url == f"http://{head.store_host}:{COORDINATOR_PORT}"
    (raw,) = _instances(ec2, [head.instance_id])
    assert _tags(raw)[TAG_ROLE] == "head"
    assert "InstanceLifecycle" not in raw  # on-demand
    assert raw["InstanceType"] == "t3.small"
    assert raw["MetadataOptions"]["HttpTokens"] == "required"
    assert p.ensure_head().instance_id == head.instance_id
    # A lost head is replaced by a new one, not resurrected through the old token.
    p.terminate([head.instance_id])
    assert p.ensure_head().instance_id != head.instance_id
    heads = [i for i in p.list(p.ctx.cluster) if i.role == "head"]
    assert len(heads) == 1


def test_cleanup_leaves_no_instance_group_or_key(make_provider: MakeProvider, ec2: Any) -> None:
    p = make_provider(instance_types=TYPES)
    p.launch(_offer(p), 2, "req-c")
    p.ensure_head()
    assert len(p.list(p.ctx.cluster)) == 3
    assert p.cleanup() == []
    assert p.list(p.ctx.cluster) == []
    flt = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [p.ctx.cluster]}]
    assert ec2.describe_security_groups(Filters=flt)["SecurityGroups"] == []
    assert ec2.describe_key_pairs(Filters=flt)["KeyPairs"] == []
    live = [
        i
        for r in ec2.describe_instances(Filters=flt)["Reservations"]
        for i in r["Instances"]
        if i["State"]["Name"] != "terminated"
    ]
    assert live == []
    assert not p.key_path.exists()
    assert p.cleanup() == []  # twice is fine


def test_key_pair_with_lost_private_key_is_replaced(make_provider: MakeProvider) -> None:
    p = make_provider(instance_types=TYPES)
    p.prepare()
    first = p.key_path.read_text()
    p.key_path.unlink()
    again = make_provider(name=p.ctx.cluster, instance_types=TYPES)
    again.prepare()
    assert again.key_path.exists() and again.key_path.read_text() != first
    assert again.cleanup() == []


def test_catalog_offers_cannot_be_launched(make_provider: MakeProvider) -> None:
    p = make_provider(instance_types=TYPES)
    offer = next(o for o in catalog_aws.load_offers("us-east-1") if o.instance_type == "g5.xlarge")
    with pytest.raises(SpecError, match="zone ID"):
        p.launch(offer, 1, "req-cat")
    assert p.list(p.ctx.cluster) == []


def test_terminate_many_unknown_ids_in_chunks(make_provider: MakeProvider) -> None:
    p = make_provider(instance_types=TYPES)
    (keep,) = p.launch(_offer(p), 1, "req-many")
    p.terminate([f"i-{n:017x}" for n in range(250)])
    assert [i.id for i in p.list(p.ctx.cluster)] == [keep.id]
    p.terminate([f"i-{n:017x}" for n in range(150)] + [keep.id])
    assert p.list(p.ctx.cluster) == []


def test_a_new_head_whose_start_fails_is_terminated(
    make_provider: MakeProvider, ec2: Any, tmp_path: Path, refusing_address: str
) -> None:
    """The head VM is reached over SSH to start `spotctl head`; here nothing listens at
    that address (a closed loopback port). The VM `up` just created must not stay up
    billing until `down`: it is terminated and the error says so."""
    from spotctl.errors import BootstrapError

    key = tmp_path / "key"
    key.write_text("not a key\n")
    p = make_provider(instance_types=TYPES, options={
        "head_process": True, "ssh_override": refusing_address,
        "ssh_override_key": str(key), "ssh_wait_s": 1.0,
    })  # fmt: skip
    with pytest.raises(BootstrapError, match=r"head .*was terminated") as err:
        p.ensure_head()
    (raw,) = [i for r in ec2.describe_instances(Filters=[
        {"Name": f"tag:{TAG_CLUSTER}", "Values": [p.ctx.cluster]}])["Reservations"]
        for i in r["Instances"]]  # fmt: skip
    assert _tags(raw)[TAG_ROLE] == "head"
    assert raw["State"]["Name"] in ("shutting-down", "terminated"), raw["State"]
    assert raw["InstanceId"] in str(err.value)
