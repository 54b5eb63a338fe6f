"""The fast network per machine family on GCP: gVNIC on GPU workers and the cluster's
compact placement policy per zone, through the real client against the fake, which
refuses what GCP refuses (unknown or foreign-region policies, compact placement on a
family without it, one policy's VMs in two zones, deleting a policy in use)."""

from __future__ import annotations

import pytest

from spotctl.errors import ProviderError
from spotctl.providers.gcp import placement
from spotctl.providers.gcp.provider import GcpProvider

from .conftest import PROJECT, make_ctx

pytestmark = pytest.mark.gcp


def _offer(p: GcpProvider, machine: str, gpu: str, zone: str = "us-central1-a"):
    return next(o for o in p.offers()
                if o.zone == zone and o.instance_type == machine and o.gpu_name == gpu)


def _policy_url(cluster: str, zone: str) -> str:
    return (f"projects/{PROJECT}/regions/us-central1/resourcePolicies/"
            f"{placement.policy_name(cluster, zone)}")


def test_a2_gets_gvnic_and_the_zones_compact_placement_policy(fake, provider):
    (inst,) = provider.launch(_offer(provider, "a2-highgpu-1g", "A100"), 1, "a2")
    body = fake.calls("instances.insert")[-1].body
    assert body["networkInterfaces"][0]["nicType"] == "GVNIC"
    assert body["resourcePolicies"] == [_policy_url("demo", "us-central1-a")]
    assert body["labels"][placement.LABEL_NETWORK] == "gvnic-compact"
    assert body["scheduling"]["onHostMaintenance"] == "TERMINATE"
    (pol,) = fake.policies.values()
    assert pol["groupPlacementPolicy"] == {"collocation": "COLLOCATED"}
    assert pol["description"] == placement.policy_description("demo")
    assert inst.meta["network"] == "gvnic-compact"
    # the same zone again: the same policy, not a second one
    provider.launch(_offer(provider, "a2-highgpu-1g", "A100"), 1, "a2-more")
    assert len(fake.policies) == 1 and len(fake.calls("resourcePolicies.insert")) == 1


def test_n1_with_t4_gets_gvnic_without_compact_placement(fake, provider):
    (inst,) = provider.launch(_offer(provider, "n1-standard-8", "T4"), 1, "n1")
    body = fake.calls("instances.insert")[-1].body
    assert body["networkInterfaces"][0]["nicType"] == "GVNIC"
    assert not body.get("resourcePolicies") and fake.policies == {}
    assert inst.meta["network"] == "gvnic"


def test_fast_network_off_keeps_only_what_the_family_requires(fake, spotctl_home):
    ctx = make_ctx(fake, spotctl_home)
    ctx.spec.placement.fast_network = False
    p = GcpProvider(ctx)
    p.launch(_offer(p, "a2-highgpu-1g", "A100"), 1, "a2-plain")
    body = fake.calls("instances.insert")[-1].body
    assert body["networkInterfaces"][0].get("nicType") is None
    assert not body.get("resourcePolicies") and fake.policies == {}
    p.launch(_offer(p, "g2-standard-4", "L4"), 1, "g2-plain")  # g2 takes gVNIC only
    assert fake.calls("instances.insert")[-1].body["networkInterfaces"][0]["nicType"] == "GVNIC"


def test_a_policy_per_zone_and_down_removes_them(fake, provider):
    provider.launch(_offer(provider, "a2-highgpu-1g", "A100", "us-central1-a"), 1, "za")
    provider.launch(_offer(provider, "a2-highgpu-1g", "A100", "us-central1-b"), 1, "zb")
    assert sorted(n for _r, n in fake.policies) == [
        placement.policy_name("demo", "us-central1-a"),
        placement.policy_name("demo", "us-central1-b")]
    # the fake refuses a policy in use, as GCP does
    with pytest.raises(ProviderError, match="already being used"):
        provider._call("delete policy", lambda: provider.clients.resource_policies.delete_unary(
            project=PROJECT, region="us-central1",
            resource_policy=placement.policy_name("demo", "us-central1-a"), retry=None))
    assert provider.cleanup() == []
    assert fake.policies == {} and fake.instances == {}


def test_the_fake_refuses_what_gcp_refuses_about_placement(fake, provider):
    provider.launch(_offer(provider, "a2-highgpu-1g", "A100", "us-central1-a"), 1, "first")
    url = _policy_url("demo", "us-central1-a")
    cases = [
        # one compact policy's VMs are in one zone
        ("us-central1-b", "a2-highgpu-1g", url, "cannot join it"),
        # compact placement only on the families that take it
        ("us-central1-a", "n1-standard-8", url, "not supported for machine type"),
        # a policy that does not exist
        ("us-central1-a", "a2-highgpu-1g", url + "-nope", "was not found"),
    ]
    for zone, machine, policy, why in cases:
        res = provider._instance_resource(name=f"x-{len(fake.instances)}", zone=zone,
                                          machine_type=machine, role="worker", rid="x",
                                          spot=True, gpus=1, policy=policy)
        with pytest.raises(ProviderError, match=why):
            provider._insert(zone, res, f"refused-{zone}-{machine}-{policy[-4:]}")


def test_describe_names_the_network_a_node_gets() -> None:
    assert placement.describe("a2-highgpu-8g", 8, True) == "gVNIC, compact placement"
    # the A3 types whose bandwidth between VMs needs GPUDirect's extra NICs are never
    # planned with the fast network on (refused below), so no plan line names them
    assert placement.describe("a3-highgpu-4g", 4, True) == "gVNIC, compact placement"
    assert placement.describe("n1-standard-8", 1, True) == (
        "gVNIC (no compact placement for this family)")
    assert placement.describe("a2-highgpu-1g", 1, False).startswith("VirtIO (fast network off")
    assert placement.describe("e2-small", 0, True) == "VirtIO"


def test_a3_types_that_need_gpudirect_nics_are_refused_while_the_fast_network_is_on(
    fake, spotctl_home
):
    from spotctl.errors import SpecError

    # not named: left out of the offers (an H100 cluster gets a3-highgpu-1g..4g VMs)
    p = GcpProvider(make_ctx(fake, spotctl_home, gpu="H100"))
    types = {o.instance_type for o in p.offers()}
    assert types and "a3-highgpu-8g" not in types and "a3-megagpu-8g" not in types, types
    assert types <= {"a3-highgpu-1g", "a3-highgpu-2g", "a3-highgpu-4g"}, types
    # named: one line saying what is missing and the two ways out
    named = GcpProvider(make_ctx(fake, spotctl_home, machine_types=["a3-megagpu-8g"]))
    with pytest.raises(SpecError) as e:
        named.offers()
    msg = str(e.value)
    assert msg.startswith("gcp.machine_types: a3-megagpu-8g needs GPUDirect-TCPXO, 8 extra "
                          "NICs, which spotctl does not set up") and "\n" not in msg
    assert "fast_network = false" in msg
    # the fast network off: the user takes one gVNIC, and the type is offered and launches
    ctx = make_ctx(fake, spotctl_home, machine_types=["a3-highgpu-8g"])
    ctx.spec.placement.fast_network = False
    off = GcpProvider(ctx)
    offers = off.offers()
    assert {o.instance_type for o in offers} == {"a3-highgpu-8g"}
    assert placement.describe("a3-highgpu-8g", 8, False).startswith("gVNIC (fast network off")
