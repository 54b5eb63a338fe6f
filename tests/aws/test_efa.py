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
    # several interfaces: no public address asked at launch (EC2 refuses it)
    assert not [n for n in nics if "AssociatePublicIpAddress" in n]
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


def test_a_public_address_with_several_interfaces_is_refused_as_ec2_does(
    make_provider: MakeProvider, ec2: Any, ami: str
) -> None:
    """EC2 API reference, InstanceNetworkInterfaceSpecification.AssociatePublicIpAddress:
    "The public IP address can only be assigned to a network interface for eth0 ... You
    cannot specify more than one network interface in the request." EC2 answers
    InvalidParameterCombination; the stand-in does too, DryRun or not."""
    sub = _subnet(ec2, "us-east-1a")
    nics = [{"SubnetId": sub, "NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "efa",
             "AssociatePublicIpAddress": True},
            {"SubnetId": sub, "NetworkCardIndex": 1, "DeviceIndex": 0,
             "InterfaceType": "efa-only"}]
    for dry in (True, False):
        with pytest.raises(Exception, match="InvalidParameterCombination.*associatePublicIP"
                                            "Address parameter cannot be specified when "
                                            "launching with multiple network interfaces"):
            ec2.run_instances(ImageId=ami, InstanceType="p5.48xlarge", MinCount=1, MaxCount=1,
                              NetworkInterfaces=nics, DryRun=dry)
    # one interface may ask for one
    one = efa.network_interfaces("g5.8xlarge", 1, sub, "", public=True)
    assert one[0]["AssociatePublicIpAddress"] is True
    # spotctl's own layouts never ask for one with several interfaces
    for t, (n, _) in efa.EFA.items():
        layout = efa.network_interfaces(t, n, sub, "sg-1", public=True)
        assert (n > 1) == (not any("AssociatePublicIpAddress" in x for x in layout)), t
        assert efa.elastic_ip(t, n) == (n > 1)


def test_a_node_with_several_interfaces_gets_an_elastic_ip_released_by_down(
    make_provider: MakeProvider, ec2: Any
) -> None:
    """The reachable EFA node: launched without a public address, it gets one of the
    cluster's Elastic IPs on its primary interface once it runs (bootstrap does it before
    the first SSH); a node gone leaves its address to the next; `down` releases them."""
    p = make_provider(instance_types=TYPES)
    (a,) = p.launch(_offer(p, "p4d.24xlarge"), 1, "req-eip-a")
    assert not _raw(ec2, [a.id])[0].get("PublicIpAddress")
    raw = p._ensure_public_address(p._wait_running(a.id))
    flt = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [p.ctx.cluster]}]
    (addr,) = ec2.describe_addresses(Filters=flt)["Addresses"]
    assert raw["PublicIpAddress"] == addr["PublicIp"] and p._to_instance(raw).public_address
    assert p._ensure_public_address(raw) == raw  # once is enough
    # a plain node keeps the address its launch asked for: no Elastic IP
    (g5,) = p.launch(_offer(p, "g5.xlarge"), 1, "req-eip-g5")
    p._ensure_public_address(p._wait_running(g5.id))
    assert len(ec2.describe_addresses(Filters=flt)["Addresses"]) == 1
    # the node goes (a preemption): its address is free, and the next node takes it
    p.terminate([a.id])
    (b,) = p.launch(_offer(p, "p4d.24xlarge"), 1, "req-eip-b")
    raw_b = p._ensure_public_address(p._wait_running(b.id))
    assert raw_b["PublicIpAddress"] == addr["PublicIp"]
    assert len(ec2.describe_addresses(Filters=flt)["Addresses"]) == 1
    assert p.cleanup() == []
    assert ec2.describe_addresses(Filters=flt)["Addresses"] == []


def test_a_refused_interface_layout_fails_over_to_the_next_offer(
    make_provider: MakeProvider, ec2: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were EC2 to refuse a type's layout (InvalidParameterCombination), the walk moves on
    to the next offer (a plain type launches) instead of stopping at the first."""
    from spotctl.errors import CapacityError
    from spotctl.providers.aws.launch import launch_with_failover

    p = make_provider(instance_types=TYPES)
    real = efa.network_interfaces

    def old_layout(*args: Any, **kw: Any) -> list[dict[str, Any]]:  # main's request
        out = real(*args, **kw)
        out[0]["AssociatePublicIpAddress"] = True
        return out

    monkeypatch.setattr(efa, "network_interfaces", old_layout)
    with pytest.raises(CapacityError, match="InvalidParameterCombination"):
        p.launch(_offer(p, "p4d.24xlarge"), 1, "req-layout-1")
    offer, insts = launch_with_failover(
        p, [_offer(p, "p4d.24xlarge"), _offer(p, "g5.xlarge")], 1, "req-layout-2")
    assert offer.instance_type == "g5.xlarge" and len(insts) == 1
    assert p.cleanup() == []


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
    """EFA's requirement (EC2 User Guide, "Prepare an EFA-enabled security group"): all
    traffic in from and out to the group itself; a 0.0.0.0/0 egress rule does not carry
    EFA, which is not IP. Two EFA nodes "connect" (the stand-in's NCCL-over-EFA
    handshake) only then; a group made before the egress rule gets it at the next `up`."""
    p = make_provider(instance_types=TYPES)
    p.prepare()
    flt = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [p.ctx.cluster]}]
    (g,) = ec2.describe_security_groups(Filters=flt)["SecurityGroups"]
    gid = g["GroupId"]
    ingress = [r for r in g["IpPermissions"] if r["IpProtocol"] == "-1"]
    assert [[x["GroupId"] for x in r["UserIdGroupPairs"]] for r in ingress] == [[gid]]
    egress = [r for r in g["IpPermissionsEgress"] if r["IpProtocol"] == "-1"]
    assert any({"CidrIp": "0.0.0.0/0"} in r.get("IpRanges", []) for r in egress)
    assert [x["GroupId"] for r in egress for x in r.get("UserIdGroupPairs", [])] == [gid]
    a, b = p.launch(_offer(p, "p4d.24xlarge"), 2, "req-sg")
    ec2_placement.efa_connect(ec2, a.id, b.id)
    # without the egress rule (a group as main made it), the handshake fails
    own = [r for r in egress if r.get("UserIdGroupPairs")]
    ec2.revoke_security_group_egress(GroupId=gid, IpPermissions=own)
    with pytest.raises(ec2_placement.EfaRefused, match="no egress rule"):
        ec2_placement.efa_connect(ec2, a.id, b.id)
    again = make_provider(name=p.ctx.cluster, instance_types=TYPES)
    again.prepare()
    ec2_placement.efa_connect(ec2, a.id, b.id)
    assert again.cleanup() == []


def test_describe_names_the_network_a_node_gets() -> None:
    assert efa.describe("p5.48xlarge", True) == "EFA x32, cluster placement group, Elastic IP"
    assert efa.describe("p5.4xlarge", True) == "EFA x1, cluster placement group"
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
    assert actions and {a["network"] for a in actions} == {
        "EFA x4, cluster placement group, Elastic IP"}
    res = CliRunner().invoke(app, ["up", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "network EFA x4, cluster placement group, Elastic IP" in res.stdout, res.stdout
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
