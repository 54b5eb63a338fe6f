"""The fast network per instance type on AWS: EFA interfaces and the cluster's placement
group, checked against the documented request shape and against a stand-in that refuses
what EC2 refuses (tests/aws/ec2_placement.py: moto has no placement groups and takes any
interface list)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from spotctl.errors import SpecError
from spotctl.providers.aws import catalog as catalog_aws
from spotctl.providers.aws import efa
from spotctl.providers.aws.api import TAG_CLUSTER, TAG_NETWORK
from spotctl.providers.aws.provider import AwsProvider
from spotctl.providers.base import HeadInfo, ProviderContext
from spotctl.remote.bootstrap import CloudNodes

from . import ec2_placement

pytestmark = pytest.mark.aws

MakeProvider = Callable[..., AwsProvider]
TYPES = ["g5.xlarge", "p4d.24xlarge", "p5.48xlarge"]


def _offer(p: AwsProvider, itype: str, zone: str = "us-east-1a") -> Any:
    return next(o for o in p.offers() if o.instance_type == itype and o.zone == zone)


def _raw(ec2: Any, ids: list[str]) -> list[dict[str, Any]]:
    return [i for r in ec2.describe_instances(InstanceIds=ids)["Reservations"]
            for i in r["Instances"]]


def _last_request(itype: str) -> dict[str, Any]:
    return next(r for r in reversed(ec2_placement.REQUESTS) if r["InstanceType"] == itype)


def _subnet(ec2: Any, zone: str) -> str:
    subs = ec2.describe_subnets(Filters=[{"Name": "availability-zone", "Values": [zone]}])
    return sorted(s["SubnetId"] for s in subs["Subnets"])[0]


def test_the_efa_table_agrees_with_ec2s_instance_type_data() -> None:
    """Every EFA type of the default image's families is in the table with EC2's count
    (moto ships DescribeInstanceTypes' data), and no type without EFA is."""
    from moto.ec2.models.instance_types import INSTANCE_TYPES

    want = {}
    for t, d in INSTANCE_TYPES.items():
        net = d.get("NetworkInfo", {})
        if t.split(".")[0] in catalog_aws.DLAMI_FAMILIES and net.get("EfaSupported"):
            want[t] = int(net["EfaInfo"]["MaximumEfaInterfaces"])
    assert {t: n for t, (n, _) in efa.EFA.items() if t in INSTANCE_TYPES} == want
    for t, (n, _) in efa.EFA.items():
        assert n <= INSTANCE_TYPES[t]["NetworkInfo"]["MaximumNetworkCards"], t


def test_p5_gets_32_efa_interfaces_one_per_card_in_the_zones_placement_group(
    make_provider: MakeProvider, ec2: Any
) -> None:
    p = make_provider(instance_types=TYPES)
    (inst,) = p.launch(_offer(p, "p5.48xlarge"), 1, "req-p5")
    req = _last_request("p5.48xlarge")
    nics = req["NetworkInterfaces"]
    group = f"spotctl-{p.ctx.cluster}-us-east-1a"
    assert req["Placement"] == {"AvailabilityZone": "us-east-1a", "GroupName": group}
    # EC2 User Guide: the primary on card 0 / device 0 (an EFA with ENA, carrying the
    # node's address), then one EFA-only interface per further card at device index 0
    assert [(int(n["NetworkCardIndex"]), int(n["DeviceIndex"]), n["InterfaceType"])
            for n in nics] == [(0, 0, "efa")] + [(c, 0, "efa-only") for c in range(1, 32)]
    assert [n.get("AssociatePublicIpAddress") for n in nics[:2]] == [True, None]
    sub = _subnet(ec2, "us-east-1a")
    (gid,) = {g for n in nics for g in n["Groups"]}
    assert {n["SubnetId"] for n in nics} == {sub}
    assert all(n["DeleteOnTermination"] in (True, "true") for n in nics)
    (raw,) = _raw(ec2, [inst.id])
    assert raw["Placement"]["GroupName"] == group
    assert {t["Key"]: t["Value"] for t in raw["Tags"]}[TAG_NETWORK] == "efa32"
    (listed,) = p.list(p.ctx.cluster)
    assert listed.meta["network"] == "efa32"
    assert listed.meta["node_env"] == {"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1",
                                       "FI_EFA_USE_DEVICE_RDMA": "1"}
    assert gid.startswith("sg-")


def test_p4d_gets_4_efa_with_ena_and_g5_xlarge_one_plain_interface(
    make_provider: MakeProvider, ec2: Any
) -> None:
    p = make_provider(instance_types=TYPES)
    (p4,) = p.launch(_offer(p, "p4d.24xlarge"), 1, "req-p4")
    nics = _last_request("p4d.24xlarge")["NetworkInterfaces"]
    assert [(int(n["NetworkCardIndex"]), int(n["DeviceIndex"]), n["InterfaceType"])
            for n in nics] == [(0, 0, "efa"), (1, 1, "efa"), (2, 1, "efa"), (3, 1, "efa")]
    (g5,) = p.launch(_offer(p, "g5.xlarge"), 1, "req-g5")
    req = _last_request("g5.xlarge")
    assert req["NetworkInterfaces"] == [] and req["Placement"]["GroupName"] == ""
    by_id = {i.id: i for i in p.list(p.ctx.cluster)}
    assert by_id[g5.id].meta["network"] == "ena" and by_id[g5.id].meta["node_env"] == {}
    assert by_id[p4.id].meta["network"] == "efa4"
    # the workers' agents get the node's network environment; the spec's own env wins
    p.ctx.spec.train.env = {"FI_EFA_FORK_SAFE": "0"}
    nodes = CloudNodes(p.ctx, metadata="aws", metadata_url="", api_port=1, store_port=2)
    head = HeadInfo(url="http://10.0.0.1:1", store_host="10.0.0.1", store_port=2,
                    lighthouse="http://10.0.0.1:3")
    cfg = nodes.agent_config(by_id[p4.id], head)
    assert cfg.env == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1",
                       "FI_EFA_FORK_SAFE": "0"}
    assert nodes.agent_config(by_id[g5.id], head).env == {"FI_EFA_FORK_SAFE": "0"}


def test_fast_network_off_launches_efa_types_plainly(moto_url: str, ami: str, home: Any,
                                                      ec2: Any) -> None:
    from spotctl.providers.aws.provider import create
    from spotctl.spec import ClusterSpec
    from spotctl.state import Store

    from .conftest import FAST

    spec = ClusterSpec.model_validate({
        "name": "plainnet", "provider": "aws", "placement": {"fast_network": False},
        "aws": {"region": "us-east-1", "ami": ami, "ssh_cidr": "198.51.100.7/32",
                "instance_types": ["p4d.24xlarge"]}})
    p = create(ProviderContext(cluster="plainnet", spec=spec,
                               cluster_dir=Store().cluster_dir("plainnet").ensure(),
                               options=dict(FAST)))
    (inst,) = p.launch(_offer(p, "p4d.24xlarge"), 1, "req-plain")
    req = _last_request("p4d.24xlarge")
    assert req["NetworkInterfaces"] == [] and req["Placement"]["GroupName"] == ""
    assert p.list("plainnet")[0].meta["network"] == "ena"
    assert p.cleanup() == []


def test_a_placement_group_per_zone_and_down_removes_them(
    make_provider: MakeProvider, ec2: Any
) -> None:
    p = make_provider(instance_types=TYPES)
    a = p.launch(_offer(p, "p4d.24xlarge", "us-east-1a"), 2, "req-a")
    p.launch(_offer(p, "p4d.24xlarge", "us-east-1a"), 1, "req-a2")  # the same group again
    b = p.launch(_offer(p, "p4d.24xlarge", "us-east-1b"), 1, "req-b")
    flt = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [p.ctx.cluster]}]
    groups = ec2.describe_placement_groups(Filters=flt)["PlacementGroups"]
    assert sorted((g["GroupName"], g["Strategy"]) for g in groups) == [
        (f"spotctl-{p.ctx.cluster}-us-east-1a", "cluster"),
        (f"spotctl-{p.ctx.cluster}-us-east-1b", "cluster")]
    assert {r["Placement"]["GroupName"] for r in _raw(ec2, [i.id for i in a + b])} == {
        g["GroupName"] for g in groups}
    # the stand-in refuses what EC2 refuses: a cluster group's instances share one zone
    with pytest.raises(Exception, match="cannot span Availability Zones"):
        ec2.run_instances(ImageId=p._ami(), InstanceType="p4d.24xlarge", MinCount=1,
                          MaxCount=1, Placement={"AvailabilityZone": "us-east-1b",
                                                 "GroupName": groups[0]["GroupName"]})
    # ...and a group in use cannot be deleted
    with pytest.raises(Exception, match="InUse"):
        ec2.delete_placement_group(GroupName=groups[0]["GroupName"])
    assert p.cleanup() == []
    assert ec2.describe_placement_groups(Filters=flt)["PlacementGroups"] == []


def test_efa_where_the_type_has_none_is_refused_before_any_call(ec2: Any, ami: str) -> None:
    with pytest.raises(SpecError, match="g5.xlarge has no EFA interfaces"):
        efa.network_interfaces("g5.xlarge", 1, "subnet-1", "sg-1", public=True)
    with pytest.raises(SpecError, match="p4d.24xlarge has 4 EFA interfaces; 5 asked"):
        efa.network_interfaces("p4d.24xlarge", 5, "subnet-1", "sg-1", public=True)
    assert efa.network_interfaces("g5.xlarge", 0, "subnet-1", "sg-1", public=False) == [
        {"SubnetId": "subnet-1", "Groups": ["sg-1"], "DeleteOnTermination": True,
         "NetworkCardIndex": 0, "DeviceIndex": 0}]
    # the stand-in refuses the same, as EC2 does, were a request to reach it
    sub = _subnet(ec2, "us-east-1a")
    for itype, nics, why in [
        ("g5.xlarge", efa.network_interfaces("p4d.24xlarge", 1, sub, "", False),
         "does not support Elastic Fabric Adapter"),
        ("p4d.24xlarge", efa.network_interfaces("p5.48xlarge", 5, sub, "", False),
         "out of range"),
        ("p5.48xlarge", [{"SubnetId": sub, "DeviceIndex": 0, "NetworkCardIndex": 0,
                          "InterfaceType": "efa-only"}], "cannot be the primary"),
    ]:
        for n in nics:
            n.pop("Groups", None)
        with pytest.raises(Exception, match=why):
            ec2.run_instances(ImageId=ami, InstanceType=itype, MinCount=1, MaxCount=1,
                              NetworkInterfaces=nics)


def test_the_security_group_lets_all_traffic_to_and_from_itself(
    make_provider: MakeProvider, ec2: Any
) -> None:
    """EFA's requirement: every protocol and port between members of the group."""
    p = make_provider(instance_types=TYPES)
    p.prepare()
    (g,) = ec2.describe_security_groups(
        Filters=[{"Name": f"tag:{TAG_CLUSTER}", "Values": [p.ctx.cluster]}])["SecurityGroups"]
    ingress = [r for r in g["IpPermissions"] if r["IpProtocol"] == "-1"]
    assert [[x["GroupId"] for x in r["UserIdGroupPairs"]] for r in ingress] == [[g["GroupId"]]]
    assert any(r["IpProtocol"] == "-1" and {"CidrIp": "0.0.0.0/0"} in r.get("IpRanges", [])
               for r in g["IpPermissionsEgress"])


def test_describe_names_the_network_a_node_gets() -> None:
    assert efa.describe("p5.48xlarge", True) == "EFA x32, cluster placement group"
    assert efa.describe("p5.48xlarge", False).startswith("ENA (fast network off")
    assert efa.describe("g5.xlarge", True) == "ENA (no EFA on this type)"


def test_up_dry_run_names_each_launchs_network(
    home: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, ec2: Any
) -> None:
    import json

    from typer.testing import CliRunner

    from spotctl.cli.app import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "spotctl.toml").write_text(
        'name = "efadry"\nprovider = "aws"\ngpus = "16..16"\n'
        '[aws]\nregion = "us-east-1"\ninstance_types = ["p4d.24xlarge"]\n'
        'ssh_cidr = "198.51.100.7/32"\n')
    res = CliRunner().invoke(app, ["up", "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    actions = json.loads(res.stdout)["actions"]
    assert actions and {a["network"] for a in actions} == {"EFA x4, cluster placement group"}
    res = CliRunner().invoke(app, ["up", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "network EFA x4, cluster placement group" in res.stdout, res.stdout
    # nothing was made: the dry run creates no placement group either
    flt = [{"Name": "tag:spotctl:cluster", "Values": ["efadry"]}]
    assert ec2.describe_placement_groups(Filters=flt)["PlacementGroups"] == []


def test_status_json_shows_each_nodes_network(make_provider: MakeProvider, home: Any) -> None:
    """What the launch gave each node, as journaled by the reconciler, in status --json."""
    from spotctl.control import status
    from spotctl.control.reconcile import _row
    from spotctl.state import Store

    p = make_provider(instance_types=TYPES)
    (p4,) = p.launch(_offer(p, "p4d.24xlarge"), 1, "req-st-p4")
    (g5,) = p.launch(_offer(p, "g5.xlarge"), 1, "req-st-g5")
    store = Store()
    name = p.ctx.cluster
    store.upsert_cluster(name, "aws", p.ctx.spec.model_dump(), "up")
    for inst in p.list(name):
        store.upsert_node(_row(inst, name, "aws"))
    snap = status.collect(store, name)
    assert {n["id"]: n["network"] for n in snap["nodes"]} == {p4.id: "efa4", g5.id: "ena"}
    assert p.cleanup() == []
