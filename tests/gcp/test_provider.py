"""The GCP provider through the real google-cloud-compute client against the fake REST server."""

from __future__ import annotations

import pytest

from spotctl.errors import (
    AuthError,
    CapacityError,
    ProviderError,
    QuotaError,
    SpecError,
    TransientError,
)
from spotctl.providers.gcp.api import instance_name
from spotctl.providers.gcp.provider import GcpProvider

from .conftest import CIDR, GCP_NOTHING, PROJECT, gcp_leftovers, make_ctx

pytestmark = pytest.mark.gcp


def _offer(
    p: GcpProvider, zone: str = "us-central1-a", machine: str = "n1-standard-8", gpu: str = "T4"
):
    return next(
        o
        for o in p.offers()
        if o.zone == zone and o.instance_type == machine and o.gpu_name == gpu and o.gpus == 1
    )


def test_launch_sends_spot_scheduling_labels_key_and_accelerator(fake, provider):
    offer = _offer(provider)
    out = provider.launch(offer, 2, "Req-1")
    assert [i.id for i in out] == [instance_name("demo", "Req-1", k) for k in range(2)]
    assert {i.zone for i in out} == {"us-central1-a"}
    assert all(i.state == "running" and i.spot and i.gpus == 1 for i in out)
    assert all(i.address.startswith("10.") and i.public_address for i in out)
    assert out[0].price == pytest.approx(offer.spot_price)
    inserts = fake.calls("instances.insert")
    assert len(inserts) == 2
    body = inserts[0].body
    assert body["scheduling"] == {
        "provisioningModel": "SPOT",
        "instanceTerminationAction": "DELETE",
        "onHostMaintenance": "TERMINATE",
        "automaticRestart": False,
    }
    assert body["labels"] == {
        "spotctl-cluster": "demo",
        "spotctl-role": "worker",
        "spotctl-request-id": "req-1",
        "spotctl-network": "gvnic",
    }
    # no network tag (the firewall rules pick members by service account), and the
    # region's subnetwork named, which the head's networkUser binding is on
    assert "tags" not in body
    assert body["networkInterfaces"][0]["subnetwork"] == "regions/us-central1/subnetworks/default"
    assert body["guestAccelerators"] == [
        {
            "acceleratorCount": 1,
            "acceleratorType": f"projects/{PROJECT}/zones/us-central1-a/acceleratorTypes/nvidia-tesla-t4",
        }
    ]
    meta = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    assert meta["ssh-keys"].startswith("spotctl:ssh-ed25519 ")
    assert body["machineType"] == "zones/us-central1-a/machineTypes/n1-standard-8"
    assert inserts[0].query["requestId"]  # server-side dedupe of a re-sent insert
    # The private half of the key stays on the controller, mode 0600.
    key = provider.ctx.path / "ssh" / "id_ed25519"
    assert key.exists() and (key.stat().st_mode & 0o777) == 0o600


def test_bundled_machine_type_has_no_guest_accelerator(fake, provider):
    offer = _offer(provider, machine="a2-highgpu-1g", gpu="A100")
    [inst] = provider.launch(offer, 1, "r-a2")
    assert "guestAccelerators" not in fake.calls("instances.insert")[0].body
    assert inst.gpus == 1 and inst.instance_type == "a2-highgpu-1g"


def test_launch_is_idempotent_by_request_id(fake, provider):
    offer = _offer(provider)
    first = provider.launch(offer, 2, "same")
    again = provider.launch(offer, 2, "same")
    assert sorted(i.id for i in again) == sorted(i.id for i in first)
    assert len(fake.calls("instances.insert")) == 2
    assert len(fake.instances) == 2


def test_operations_pending_then_done_are_waited_on_the_same_endpoint(fake, provider):
    fake.pending_polls = 3
    [inst] = provider.launch(_offer(provider), 1, "slow")
    assert inst.state == "running"
    assert len(fake.calls("zoneOperations.wait")) >= 3


@pytest.mark.parametrize("style", ["operation", "http503", "http400"])
def test_zone_exhaustion_fails_over_to_next_zone(fake, provider, style):
    fake.exhaust("us-central1-a", style)
    out = provider.launch(_offer(provider), 2, f"fo-{style}")
    assert len(out) == 2 and all(i.zone != "us-central1-a" for i in out)
    zones = [c.path.split("/zones/")[1].split("/")[0] for c in fake.calls("instances.insert")]
    assert zones[0] == "us-central1-a" and zones[-1] != "us-central1-a"
    assert {z for (z, _n) in fake.instances} == {out[0].zone}
    # No backoff retries on the exhausted zone: at most one insert per name there.
    assert zones.count("us-central1-a") <= 2


def test_every_zone_exhausted_raises_capacity_error(fake, spotctl_home):
    p = GcpProvider(make_ctx(fake, spotctl_home, zones=["us-central1-a", "us-central1-b"]))
    fake.exhaust("us-central1-a")
    fake.exhaust("us-central1-b", "http503")
    with pytest.raises(CapacityError) as e:
        p.launch(_offer(p), 1, "none")
    msg = str(e.value)
    assert "\n" not in msg and "us-central1-a" in msg and "us-central1-b" in msg
    assert fake.instances == {}


def test_inserts_go_out_in_parallel(fake, provider):
    fake.insert_latency_s = 0.2
    out = provider.launch(_offer(provider), 12, "wide")
    assert len(out) == 12 and len(fake.calls("instances.insert")) == 12
    # The first insert probes the zone alone, the other 11 are in flight together.
    assert fake.max_parallel_inserts >= 8


def test_unsupported_operation_fails_over_to_next_zone(fake, provider):
    fake.op_fail("UNSUPPORTED_OPERATION", 400, zone="us-central1-a", times=10)
    out = provider.launch(_offer(provider), 2, "unsup")
    assert len(out) == 2 and all(i.zone != "us-central1-a" for i in out)
    zones = [c.path.split("/zones/")[1].split("/")[0] for c in fake.calls("instances.insert")]
    assert zones.count("us-central1-a") == 2  # one try per name, then the next zone


def test_operation_rate_exceeded_backs_off_and_retries_in_the_same_zone(fake, provider):
    fake.op_fail("RESOURCE_OPERATION_RATE_EXCEEDED", 403, zone="us-central1-a", times=2)
    out = provider.launch(_offer(provider), 2, "rate")
    assert len(out) == 2 and {i.zone for i in out} == {"us-central1-a"}
    inserts = fake.calls("instances.insert")
    assert len(inserts) == 4  # both names failed once, then went again in the same zone
    # The retry is a new request (GCP would replay a reused requestId's failed operation).
    assert len({c.query["requestId"] for c in inserts}) == 4


def test_operation_rate_exceeded_everywhere_gives_up_as_transient(fake, provider):
    fake.op_fail("RESOURCE_OPERATION_RATE_EXCEEDED", 403, times=100)
    with pytest.raises(TransientError, match="RESOURCE_OPERATION_RATE_EXCEEDED") as e:
        provider.launch(_offer(provider), 1, "rate-all")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("style", ["http403", "operation"])
def test_quota_stops_with_one_clear_line(fake, provider, style):
    fake.quota(style)
    with pytest.raises(QuotaError) as e:
        provider.launch(_offer(provider), 1, "q")
    assert "\n" not in str(e.value) and "quota exceeded" in str(e.value)
    assert "GPUS_ALL_REGIONS" in str(e.value)
    # Quota is not a zone problem: no failover to other zones.
    assert len(fake.calls("instances.insert")) == 1


@pytest.mark.parametrize(
    "status,reason", [(503, "backendError"), (500, "internalError"), (429, "rateLimitExceeded")]
)
def test_transient_errors_are_retried_then_succeed(fake, provider, status, reason):
    fake.fail("instances.insert", status, reason, times=1)
    fake.fail("instances.aggregatedList", status, reason, times=1)
    [inst] = provider.launch(_offer(provider), 1, "t")
    assert inst.state == "running"
    assert len(fake.calls("instances.insert")) == 2
    assert len(fake.calls("instances.aggregatedList")) == 2


def test_persistent_5xx_gives_up_with_transient_error(fake, provider):
    fake.fail("instances.aggregatedList", 503, "backendError", times=100)
    with pytest.raises(TransientError) as e:
        provider.list("demo")
    assert "gave up after 5 attempts" in str(e.value)
    assert len(fake.calls("instances.aggregatedList")) == 5


@pytest.mark.parametrize("status,reason", [(401, "authError"), (403, "forbidden")])
def test_auth_errors_stop_at_once(fake, provider, status, reason):
    fake.fail("instances.aggregatedList", status, reason, times=5)
    with pytest.raises(AuthError):
        provider.list("demo")
    assert len(fake.calls("instances.aggregatedList")) == 1


def test_list_uses_label_filter_and_sees_only_this_cluster(fake, spotctl_home):
    a = GcpProvider(make_ctx(fake, spotctl_home, cluster="demo"))
    b = GcpProvider(make_ctx(fake, spotctl_home, cluster="demo-2"))
    a.launch(_offer(a), 1, "ra")
    b.launch(_offer(b), 2, "rb")
    assert [i.cluster for i in a.list("demo")] == ["demo"]
    assert len(b.list("demo-2")) == 2
    assert (
        fake.calls("instances.aggregatedList")[-1].query["filter"]
        == 'labels.spotctl-cluster = "demo-2"'
    )


def test_terminate_and_delete_of_gone_instance_is_noop(fake, provider):
    [inst] = provider.launch(_offer(provider), 1, "d")
    provider.terminate([inst.id])
    assert fake.instances == {}
    provider.terminate([inst.id])  # already gone: no error
    fresh = GcpProvider(provider.ctx)
    fresh._zone_of[inst.id] = inst.zone  # a stale cache still must not raise on the 404
    fresh.terminate([inst.id, "never-existed"])
    assert [c for c in fake.requests if c.method == "DELETE"][-1].path.endswith(inst.id)


def test_prepare_creates_firewall_rules_idempotently(fake, provider):
    provider.prepare()
    provider.prepare()
    assert set(fake.firewalls) == {"spotctl-demo-ssh", "spotctl-demo-internal", "spotctl-demo-deny"}
    assert len(fake.calls("firewalls.insert")) == 3
    ssh = fake.firewalls["spotctl-demo-ssh"]
    assert ssh["sourceRanges"] == [CIDR] and ssh["targetServiceAccounts"] == MEMBERS
    assert ssh["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]
    internal = fake.firewalls["spotctl-demo-internal"]
    assert internal["sourceServiceAccounts"] == MEMBERS
    assert internal["targetServiceAccounts"] == MEMBERS
    assert "sourceRanges" not in internal
    assert not any(r.get("targetTags") or r.get("sourceTags") for r in fake.firewalls.values())
    # Everything else to members is denied, ahead of the default network's stock rules
    # (default-allow-internal: every VM of the project to every port, priority 65534).
    deny = fake.firewalls["spotctl-demo-deny"]
    assert deny["denied"] == [{"IPProtocol": "all"}] and deny["sourceRanges"] == ["0.0.0.0/0"]
    assert deny["targetServiceAccounts"] == MEMBERS
    assert ssh["priority"] < deny["priority"] < 65534 and internal["priority"] < deny["priority"]


# The accounts the cluster's VMs run as: its workers', its head's.
MEMBERS = [f"spotctl-demo@{PROJECT}.iam.gserviceaccount.com",
           f"spotctlh-demo@{PROJECT}.iam.gserviceaccount.com"]  # fmt: skip

# The default network's stock rules, which the cluster's deny rule must outrank.
STOCK_RULES = [
    {"name": "default-allow-internal", "direction": "INGRESS", "priority": 65534,
     "sourceRanges": ["10.128.0.0/9"],
     "allowed": [{"IPProtocol": "tcp", "ports": ["0-65535"]}, {"IPProtocol": "udp"}]},
    {"name": "default-allow-ssh", "direction": "INGRESS", "priority": 65534,
     "sourceRanges": ["0.0.0.0/0"], "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}]},
]  # fmt: skip


def _ingress_allowed(rules, port: int, target, source: str, source_account="") -> bool:
    """GCP's ingress decision for TCP `port` on a VM running as `target` (its service
    account) from `source` (address, with the sending VM's `source_account`): the
    matching rule of the lowest priority number wins, a deny over an allow at equal
    priority; none: denied. A rule with targetServiceAccounts applies to the VMs that
    run as one of them; sourceServiceAccounts match internal traffic from such VMs
    (VPC firewall rules, "Filtering by service account versus network tag")."""
    import ipaddress

    def ports_match(perms) -> bool:
        for a in perms:
            if a["IPProtocol"] not in ("tcp", "all"):
                continue
            for spec in a.get("ports") or ["0-65535"]:
                lo, _, hi = spec.partition("-")
                if int(lo) <= port <= int(hi or lo):
                    return True
        return False

    def applies(r) -> bool:
        if r.get("direction", "INGRESS") != "INGRESS":
            return False
        assert not r.get("targetTags") and not r.get("sourceTags"), r  # not modelled
        if r.get("targetServiceAccounts") and target not in r["targetServiceAccounts"]:
            return False
        ranges = [ipaddress.ip_network(x) for x in r.get("sourceRanges", [])]
        by_range = any(ipaddress.ip_address(source) in n for n in ranges)
        by_account = bool(source_account) and source_account in r.get(
            "sourceServiceAccounts", [])
        return by_range or by_account

    hits = sorted(((int(r["priority"]), "denied" in r) for r in rules if applies(r)
                   and ports_match(r.get("denied") or r.get("allowed") or [])),
                  key=lambda h: (h[0], not h[1]))  # fmt: skip
    return bool(hits) and not hits[0][1]


def test_lighthouse_port_is_open_to_cluster_members_only(fake, provider):
    """engine torchft: the head's Lighthouse port (like the store's) answers members of
    the cluster only: not the controller, not another VM of the project, not the world."""
    from spotctl.providers.gcp.api import STORE_PORT
    from spotctl.remote.bootstrap import LIGHTHOUSE_PORT

    provider.prepare()
    rules = list(fake.firewalls.values()) + STOCK_RULES
    worker, head = MEMBERS
    other = f"other@{PROJECT}.iam.gserviceaccount.com"  # another VM of the project
    for port in (LIGHTHOUSE_PORT, STORE_PORT):
        # workers and the head reach each other, both ways
        for to, by in ((head, worker), (worker, head), (worker, worker)):
            assert _ingress_allowed(rules, port, to, "10.128.0.5", by)
        assert not _ingress_allowed(rules, port, head, "10.128.0.9", other)  # same project
        assert not _ingress_allowed(rules, port, head, "10.128.0.9")  # no account
        assert not _ingress_allowed(rules, port, head, CIDR.split("/")[0])  # controller
        assert not _ingress_allowed(rules, port, head, "198.51.100.20")  # the world
        # without the cluster's deny rule the stock rules would let the project in
        stock_only = [r for r in rules if r["name"] != "spotctl-demo-deny"]
        assert _ingress_allowed(stock_only, port, head, "10.128.0.9", other)
    for to in MEMBERS:
        assert _ingress_allowed(rules, 22, to, CIDR.split("/")[0])  # SSH: the controller
        assert not _ingress_allowed(rules, 22, to, "198.51.100.20")


def test_prepare_reconciles_a_rule_widened_by_hand(fake, provider):
    provider.prepare()
    internal = fake.firewalls["spotctl-demo-internal"]
    internal["sourceRanges"] = ["0.0.0.0/0"]  # someone opened the cluster to the world
    del internal["sourceServiceAccounts"]
    provider.prepare()  # every `up` calls it
    fixed = fake.firewalls["spotctl-demo-internal"]
    assert fixed["sourceServiceAccounts"] == MEMBERS and "sourceRanges" not in fixed
    assert [c.path.rsplit("/", 1)[-1] for c in fake.calls("firewalls.delete")] == [
        "spotctl-demo-internal"
    ]


def test_prepare_without_cidr_is_a_spec_error(fake, spotctl_home):
    p = GcpProvider(make_ctx(fake, spotctl_home, ssh_cidr=""))
    with pytest.raises(SpecError, match="gcp.ssh_cidr"):
        p.prepare()


def test_head_is_standard_vm_and_reused(fake, provider):
    head = provider.ensure_head()
    again = provider.ensure_head()
    assert head == again and head.instance_id == "demo-head"
    assert head.store_host.startswith("10.") and head.url.startswith("http://10.")
    [ins] = fake.calls("instances.insert")
    assert ins.body["scheduling"]["provisioningModel"] == "STANDARD"
    assert ins.body["labels"]["spotctl-role"] == "head"
    assert ins.body["machineType"].endswith("/e2-small")
    # The head runs a small CPU image: no GPU driver install, no DLVM-sized disk.
    disk = ins.body["disks"][0]["initializeParams"]
    assert disk["sourceImage"].endswith("/global/images/debian-12-bookworm-v20241112")
    assert int(disk["diskSizeGb"]) == 20
    meta = {i["key"] for i in ins.body["metadata"]["items"]}
    assert "install-nvidia-driver" not in meta
    # it replaces lost workers ([rebalance] on_head) as its own account
    [sa] = ins.body["serviceAccounts"]
    assert sa["email"] == "spotctlh-demo@test-proj.iam.gserviceaccount.com", sa


def test_cleanup_leaves_nothing(fake, provider):
    provider.prepare()
    provider.ensure_head()
    provider.launch(_offer(provider), 2, "c1")
    assert len(fake.instances) == 3
    assert provider.cleanup() == []
    assert fake.instances == {} and fake.firewalls == {}
    assert provider.cleanup() == []  # twice is fine


def test_cleanup_goes_on_after_an_error_and_names_what_is_left(fake, provider):
    """`down` after a partial failure: deleting the VMs is refused (403), yet the firewall
    rules and the workers' service account still go, and the VMs left are named instead
    of the first error hiding everything after it."""
    provider.prepare()
    provider.launch(_offer(provider), 1, "c2")
    fake.fail("instances.delete", 403, "forbidden", times=100)
    leaks = provider.cleanup()
    assert any(x.startswith("delete VMs:") for x in leaks), leaks
    [vm] = [n for _, n in fake.instances]
    assert any(vm in x for x in leaks if x.startswith("instance ")), leaks
    left = gcp_leftovers(fake)
    assert left["firewalls"] == [] and left["service_accounts"] == [], left
    fake.faults.clear()
    assert provider.cleanup() == []
    assert gcp_leftovers(fake) == GCP_NOTHING


def test_missing_project_is_a_spec_error(fake, spotctl_home, monkeypatch):
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    p = GcpProvider(make_ctx(fake, spotctl_home, project=""))
    with pytest.raises(SpecError, match="gcp.project"):
        p.list("demo")


# ---- images, disks and NICs that the machine families accept (the fake refuses the rest)


@pytest.mark.parametrize(
    "machine,gpu,nic", [("g2-standard-4", "L4", "GVNIC"), ("a3-highgpu-1g", "H100", "GVNIC"),
                        ("n1-standard-8", "T4", "GVNIC")]
)  # fmt: skip
def test_gpu_workers_get_dlvm_image_driver_balanced_disk_and_gvnic(
    fake, provider, machine, gpu, nic
):
    [inst] = provider.launch(_offer(provider, machine=machine, gpu=gpu), 1, f"img-{machine}")
    assert inst.state == "running"
    body = fake.calls("instances.insert")[0].body
    disk = body["disks"][0]["initializeParams"]
    assert "deeplearning-platform-release" in disk["sourceImage"]
    assert disk["diskType"] == "zones/us-central1-a/diskTypes/pd-balanced"
    assert int(disk["diskSizeGb"]) == 100
    assert body["networkInterfaces"][0].get("nicType") == nic
    meta = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    assert meta["install-nvidia-driver"] == "True"


def test_disk_is_raised_to_the_image_minimum(fake, spotctl_home):
    p = GcpProvider(make_ctx(fake, spotctl_home, disk_gb=30))
    p.launch(_offer(p), 1, "small-disk")
    disk = fake.calls("instances.insert")[0].body["disks"][0]["initializeParams"]
    assert int(disk["diskSizeGb"]) == 50  # the DLVM image's own minimum


def test_fake_refuses_pd_standard_on_g2(fake, spotctl_home):
    p = GcpProvider(make_ctx(fake, spotctl_home, disk_type="pd-standard"))
    with pytest.raises(ProviderError, match="pd-standard") as e:
        p.launch(_offer(p, machine="g2-standard-4", gpu="L4"), 1, "pdstd")
    assert not isinstance(e.value, CapacityError) and "\n" not in str(e.value)
    assert fake.instances == {}


def test_the_workers_disk_settings_are_not_the_heads(fake, spotctl_home):
    """[gcp] disk_type and disk_gb are the workers': an e2 head takes no Hyperdisk (GCP
    refuses the insert), so the head keeps its family's type and 20 GB."""
    p = GcpProvider(make_ctx(fake, spotctl_home, disk_type="hyperdisk-balanced",
                             disk_gb=500))
    p.ensure_head()
    [head] = fake.calls("instances.insert")
    disk = head.body["disks"][0]["initializeParams"]
    assert disk["diskType"].endswith("/pd-balanced") and int(disk["diskSizeGb"]) == 20, disk
    p.launch(_offer(p, machine="g2-standard-4", gpu="L4"), 1, "hd")
    disk = fake.calls("instances.insert")[1].body["disks"][0]["initializeParams"]
    assert disk["diskType"].endswith("/hyperdisk-balanced") and int(disk["diskSizeGb"]) == 500


def test_fake_refuses_hyperdisk_on_e2(fake, spotctl_home, monkeypatch):
    monkeypatch.setattr("spotctl.providers.gcp.offers.disk_type_for",
                        lambda _m: "hyperdisk-balanced")
    p = GcpProvider(make_ctx(fake, spotctl_home))
    with pytest.raises(ProviderError, match="hyperdisk-balanced"):
        p.ensure_head()


@pytest.mark.parametrize("gpu,model", [("L4", "L4"), ("nvidia-l4", "L4"),
                                       ("nvidia-tesla-t4", "T4"), ("a100-80gb", "A100-80GB"),
                                       ("nvidia-a100-80gb", "A100-80GB"),
                                       ("nvidia-tesla-a100", "A100"),
                                       ("nvidia-h100-80gb", "H100")])
def test_gpu_is_the_catalogs_name_or_gcps_accelerator_name(fake, spotctl_home, gpu, model):
    p = GcpProvider(make_ctx(fake, spotctl_home, gpu=gpu))
    got = {o.gpu_name for o in p.offers()}
    assert got == {model}, got


def test_a_gpu_gcp_does_not_sell_is_one_line(fake, spotctl_home):
    p = GcpProvider(make_ctx(fake, spotctl_home, gpu="nvidia-l40s"))
    with pytest.raises(SpecError, match=r"^gcp.gpu: 'nvidia-l40s' is not a GPU model .*L4") as e:
        p.offers()
    assert "\n" not in str(e.value)


def test_fake_refuses_a3_without_gvnic(fake, provider, monkeypatch):
    monkeypatch.setattr("spotctl.providers.gcp.placement.network_for",
                        lambda *_a: ("", False))
    with pytest.raises(ProviderError, match="gVNIC"):
        provider.launch(_offer(provider, machine="a3-highgpu-1g", gpu="H100"), 1, "nognic")
    assert fake.instances == {}


@pytest.mark.parametrize("image", [
    "projects/nope/global/images/family/x",
    # the Debian Deep Learning VM family spotctl's default named until Dec 2026: deprecated,
    # past its end of availability (Jul 2026); a family of deprecated images resolves to none
    "projects/deeplearning-platform-release/global/images/family/"
    "pytorch-2-4-cu124-debian-11-py310",
])
def test_unknown_image_is_a_spec_error(fake, spotctl_home, image):
    p = GcpProvider(make_ctx(fake, spotctl_home, image=image))
    with pytest.raises(SpecError, match="gcp.image") as e:
        p.launch(_offer(p), 1, "noimg")
    assert "\n" not in str(e.value)


def test_address_quota_stops_with_one_line(fake, provider):
    fake.address_quota["us-central1"] = 2
    with pytest.raises(QuotaError, match="IN_USE_ADDRESSES") as e:
        provider.launch(_offer(provider), 3, "addr")
    assert "\n" not in str(e.value)


def test_host_keys_from_guest_attributes_are_pinned_before_the_first_ssh(fake, provider):
    import base64

    from spotctl.providers.hostkeys import pin_host_keys

    [inst] = provider.launch(_offer(provider), 1, "hk")
    meta = {
        i["key"]: i["value"] for i in fake.calls("instances.insert")[0].body["metadata"]["items"]
    }
    assert meta["enable-guest-attributes"] == "TRUE"
    assert provider.guest_host_keys(inst.zone, inst.id) == []  # not published yet: 404
    blob = base64.b64encode(b"\x00\x00\x00\x0bssh-ed25519" + b"\x00\x00\x00\x20" + b"k" * 32)
    fake.guest_host_keys[(inst.zone, inst.id)] = {"ssh-ed25519": blob.decode()}
    keys = provider.guest_host_keys(inst.zone, inst.id)
    assert keys == [("ssh-ed25519", blob.decode())]
    kh = provider.ctx.cluster_dir.known_hosts
    # An older pin of the same address (a reused IP) is replaced, not kept next to it.
    kh.parent.mkdir(parents=True, exist_ok=True)
    kh.write_text(f"{inst.public_address} ssh-ed25519 OLDKEY\nother ssh-ed25519 KEEP\n")
    provider._pin_host_keys(inst)
    lines = kh.read_text().splitlines()
    assert lines == ["other ssh-ed25519 KEEP", f"{inst.public_address} ssh-ed25519 {blob.decode()}"]
    assert (kh.stat().st_mode & 0o777) == 0o600
    assert not pin_host_keys(kh, "h", [("ssh-ed25519", "not-base64!")])  # refused, not written


def test_a_new_head_whose_start_fails_is_deleted(fake, spotctl_home, tmp_path, refusing_address):
    """Nothing answers SSH at the head VM's address: the VM this `up` just created is
    deleted at once (not left billing until `down`), and the error says so."""
    from spotctl.errors import BootstrapError
    from spotctl.providers import get_provider

    key = tmp_path / "key"
    key.write_text("not a key\n")
    ctx = make_ctx(fake, spotctl_home)
    ctx.options.update(head_process=True, ssh_override=refusing_address,
                       ssh_override_key=str(key), ssh_wait_s=1.0)  # fmt: skip
    p = get_provider("gcp", ctx)
    with pytest.raises(BootstrapError, match=r"head VM demo-head was terminated"):
        p.ensure_head()
    assert [c.body for c in fake.calls("instances.insert")][0]["labels"]["spotctl-role"] == "head"
    assert fake.instances == {}
