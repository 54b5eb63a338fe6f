"""Issue 60, finding 6 (GCP): the head's account holds only what replacing its own workers
needs, and the fake's IAM refuses what Compute's IAM refuses under those grants.

The fake Compute server authorizes every call made with a service account's token
(tests/gcp/fake_iam.py: the project's, the subnetwork's, the resource policy's and the
service account's IAM policies; predefined and custom roles; conditions on resource names
as IAM evaluates them, "Resource attributes for IAM Conditions"). The head runs as a VM
would: google-auth's compute-engine credentials, whose token comes from the VM's metadata
server (the fake's `InstanceMetadata`), through the real google-cloud-compute client.

What `up` grants the head (spotctl/providers/gcp/storage.py), checked against Google's
documentation:
- a custom role of the project with the head's calls only (no compute.instances.setTags:
  "Create a VM that uses a user-managed service account", Required permissions: creating
  a VM with network tags needs it), bound on the project under a condition on this
  cluster's worker names (IAM, "Configure resource-based access"); instances.list is
  checked on the project, which no name condition reaches;
- roles/compute.networkUser on the cluster's subnetwork alone (subnetworks.setIamPolicy;
  `gcloud compute networks subnets add-iam-policy-binding`), not on the project;
- roles/iam.serviceAccountUser on the workers' account alone.

On the code before this change the head held project-wide roles/compute.viewer and
roles/compute.networkUser and instanceAdmin (with setTags) on its names: the get of
another cluster's VM, the other subnetwork and the tags below were all allowed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spotctl.providers import get_provider
from spotctl.providers.gcp.api import head_name, instance_name, subnetwork_name
from spotctl.providers.gcp.storage import (
    ACT_AS_ROLE,
    HEAD_NET_ROLE,
    HEAD_PERMISSIONS,
)

from .conftest import GCP_NOTHING, PROJECT, gcp_leftovers, make_ctx
from .fake_iam import ConditionError, condition_holds
from .fake_storage import InstanceMetadata

pytestmark = pytest.mark.gcp

OTHER_SA = f"team-b@{PROJECT}.iam.gserviceaccount.com"


def _client(fake: Any, creds: Any) -> Any:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    return compute_v1.InstancesClient(credentials=creds or AnonymousCredentials(), transport="rest",
                                      client_options={"api_endpoint": fake.endpoint})  # fmt: skip


def _refused(call: Any, want: str) -> None:
    """Compute's answer to a call IAM does not allow: 403 naming the permission (400
    naming the account for actAs)."""
    from google.api_core import exceptions

    with pytest.raises((exceptions.Forbidden, exceptions.BadRequest)) as e:
        call()
    assert want in str(e.value), e.value


def _insert(client: Any, zone: str, body: dict[str, Any]) -> Any:
    from google.cloud import compute_v1

    res = compute_v1.Instance.from_json(json.dumps(body), ignore_unknown_fields=True)
    return client.insert_unary(project=PROJECT, zone=zone, instance_resource=res)


def test_the_heads_account_replaces_its_workers_and_nothing_wider(
    fake: Any, spotctl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.auth import compute_engine

    ctl = get_provider("gcp", make_ctx(fake, spotctl_home))
    ctl.prepare()  # `up`: the head's account and its grants
    head = ctl.ensure_head()
    offer = next(o for o in ctl.offers() if o.gpus == 1 and o.instance_type.startswith("g2-"))
    (old,) = ctl.launch(offer, 1, "req-up")
    # another team's VM, another account, another VPC's subnetwork in the region
    anon = _client(fake, None)
    [up_body] = [r.body for r in fake.calls("instances.insert") if r.body["name"] == old.id]
    theirs = {**up_body, "name": "demo2--0123abcd-0", "serviceAccounts": []}
    _insert(anon, offer.zone, theirs)
    fake.storage.service_accounts[OTHER_SA] = {"email": OTHER_SA, "projectId": PROJECT}
    fake.networks.add("team-b")
    fake.subnetworks[("us-central1", "team-b")] = "team-b"

    md = InstanceMetadata(fake.storage, ctl.head_account, PROJECT)  # the head VM's
    try:
        from google.auth.compute_engine import _metadata

        # GCE_METADATA_HOST as google-auth read it at import (module state)
        monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", md.host)
        monkeypatch.setenv("GCE_METADATA_IP", md.host)
        creds = compute_engine.Credentials()
        ctx = make_ctx(fake, spotctl_home)
        ctx.options.update(on_head=head.instance_id, gcp_credentials=creds)
        on = get_provider("gcp", ctx)
        on.prepare()
        assert on.ensure_head().instance_id == head.instance_id
        # a notice on `old`: the head's loop launches its replacement and ends it
        n = len(fake.requests)
        (new,) = on.launch(offer, 1, "req-notice")
        on.guest_host_keys(new.zone, new.id)
        on.terminate([old.id])
        assert fake.refused == [], fake.refused
        mine = {k for k, who in fake.callers if who == ctl.head_account}
        assert {"instances.insert", "instances.delete", "instances.get",
                "instances.aggregatedList", "resourcePolicies.get"} <= mine, mine
        [sent] = [r.body for r in fake.requests[n:] if r.key == "instances.insert"]
        assert "tags" not in sent and sent["resourcePolicies"], sent
        assert sent["networkInterfaces"][0]["subnetwork"] == subnetwork_name("us-central1")

        # the request as the loop sends it, one thing changed at a time, as the head
        client = _client(fake, creds)
        ok = {**sent, "name": instance_name("demo", "req-probe", 0)}
        _insert(client, offer.zone, ok)
        nic = sent["networkInterfaces"][0]
        refused = {
            "compute.instances.setTags": {**ok, "tags": {"items": ["allow-db"]}},
            "compute.subnetworks.use": {**ok, "networkInterfaces": [
                {**nic, "network": "global/networks/team-b",
                 "subnetwork": "regions/us-central1/subnetworks/team-b"}]},
            "compute.instances.create": {**ok, "name": "team-b-worker"},
            f"service account '{OTHER_SA}'": {**ok, "serviceAccounts": [
                {"email": OTHER_SA, "scopes": sent["serviceAccounts"][0]["scopes"]}]},
        }  # fmt: skip
        for i, (want, body) in enumerate(refused.items()):
            if not want.endswith("create"):
                body = {**body, "name": f"{ok['name']}x{i}"}
            _refused(lambda body=body: _insert(client, offer.zone, body), want)
        # another region (its zone, the default network's subnetwork there)
        east = {**ok, "name": ok["name"] + "e", "networkInterfaces": [
            {**nic, "subnetwork": "regions/us-east1/subnetworks/default"}]}  # fmt: skip
        _refused(lambda: _insert(client, "us-east1-b", east), "compute.instances.create")
        assert not fake.iam.granted(ctl.head_account, "compute.subnetworks.use",
                                    f"projects/{PROJECT}/regions/us-east1/subnetworks/default",
                                    "compute.googleapis.com/Subnetwork", [
                                        fake.storage.iam_policies[f"projects/{PROJECT}"],
                                        fake.subnet_iam.get(("us-east1", "default"))])
        # another cluster's VM and the head's own: no read (its metadata), no delete
        for other in ("demo2--0123abcd-0", head_name("demo")):
            for call, perm in (
                (lambda o=other: client.get(project=PROJECT, zone=offer.zone, instance=o),
                 "compute.instances.get"),
                (lambda o=other: client.delete_unary(project=PROJECT, zone=offer.zone,
                                                     instance=o), "compute.instances.delete"),
            ):  # fmt: skip
                _refused(call, perm)
        assert (offer.zone, "demo2--0123abcd-0") in fake.instances
        # what no condition reaches: the listing, checked on the project, still shows
        # every VM of the zone with its metadata (docs/security.md says so)
        listed = {vm.name for vm in client.list(project=PROJECT, zone=offer.zone)}
        assert "demo2--0123abcd-0" in listed
        # nothing of the refused inserts exists
        names = {n for _z, n in fake.instances}
        assert names == {head.instance_id, new.id, ok["name"], "demo2--0123abcd-0"}, names
    finally:
        md.close()
    on.terminate([new.id, ok["name"]])
    fake.instances.pop((offer.zone, "demo2--0123abcd-0"))
    fake.storage.service_accounts.pop(OTHER_SA)
    assert ctl.cleanup() == []
    assert gcp_leftovers(fake) == GCP_NOTHING


def test_check_shows_what_up_grants_the_head(fake: Any, spotctl_home: Path) -> None:
    """`spotctl check`'s line for the head's rights carries the grants `up` then makes,
    the same ones: the role's permissions, the project binding and its condition, the
    subnetwork's binding and the workers' account's."""
    p = get_provider("gcp", make_ctx(fake, spotctl_home))
    c = p._check_head_rights()
    assert c.ok and "setTags" in c.detail, c.detail  # "no setTags"
    grants = c.data["grants"]
    p.prepare()
    member = f"serviceAccount:{p.head_account}"
    role = fake.storage.roles[grants["role"]["name"]]
    assert sorted(role["includedPermissions"]) == grants["role"]["includedPermissions"]
    assert set(grants["role"]["includedPermissions"]) == set(HEAD_PERMISSIONS)
    assert "compute.instances.setTags" not in role["includedPermissions"]
    project = [b for b in fake.storage.iam_policies[f"projects/{PROJECT}"]["bindings"]
               if member in b["members"]]  # fmt: skip
    assert project == grants["project"]
    sub = grants["subnetwork"]["name"].rsplit("/", 1)[-1]
    assert [b["role"] for b in fake.subnet_iam[("us-central1", sub)]["bindings"]
            if member in b["members"]] == [grants["subnetwork"]["role"]] == [HEAD_NET_ROLE]
    sa = fake.storage.iam_policies[f"serviceAccounts/{grants['serviceAccount']['name']}"]
    assert [b["role"] for b in sa["bindings"] if member in b["members"]] == [ACT_AS_ROLE]
    # nothing else anywhere names the head's account
    assert [r for r, pol in fake.storage.iam_policies.items()
            if any(member in b.get("members", []) for b in pol["bindings"])] == [
        f"projects/{PROJECT}", f"serviceAccounts/{p.node_account}"]  # fmt: skip
    assert p.cleanup() == []
    assert gcp_leftovers(fake) == GCP_NOTHING
    assert not [b for b in fake.subnet_iam[("us-central1", sub)].get("bindings", [])
                if member in b["members"]]  # fmt: skip


VM, DISK = "compute.googleapis.com/Instance", "compute.googleapis.com/Disk"
ZONE = f"projects/{PROJECT}/zones/us-central1-a"


@pytest.mark.parametrize("expr,name,type_,want", [
    ('resource.name.extract("/instances/{name}").startsWith("demo--")',
     f"{ZONE}/instances/demo--ab-0", VM, True),
    ('resource.name.extract("/instances/{name}").startsWith("demo--")',
     f"{ZONE}/instances/x-demo--ab-0", VM, False),
    ('resource.name.extract("/instances/{name}").startsWith("demo--")',
     f"{ZONE}/disks/demo--ab-0", DISK, False),  # no "/instances/": extract gives ""
    (f'resource.type != "{VM}" && resource.type != "{DISK}"', f"projects/{PROJECT}",
     "cloudresourcemanager.googleapis.com/Project", True),
    (f'(resource.type == "{VM}" && resource.name.startsWith("{ZONE}/instances/a")) || '
     f'(resource.type != "{VM}")', f"{ZONE}/instances/b", VM, False),
])  # fmt: skip
def test_the_fakes_conditions(expr: str, name: str, type_: str, want: bool) -> None:
    """IAM, "Attribute reference for IAM Conditions" (extract, startsWith) and "Resource
    attributes for IAM Conditions" (names and types of Compute resources)."""
    assert condition_holds(expr, name, type_) is want


def test_the_fakes_conditions_refuse_what_they_cannot_evaluate() -> None:
    with pytest.raises(ConditionError):
        condition_holds('resource.name.matches("^demo")', "x", VM)


def test_the_heads_condition_as_iam_reads_it(fake: Any, spotctl_home: Path) -> None:
    """This cluster's workers and their disks, and what is neither a VM nor a disk (the
    project, where list is checked); never the head, another cluster's VM or a name that
    only contains a worker's."""
    p = get_provider("gcp", make_ctx(fake, spotctl_home))
    expr = p.head_condition()["expression"]
    for n in (instance_name("demo", f"r{i}", i) for i in range(3)):
        assert condition_holds(expr, f"{ZONE}/instances/{n}", VM)
        assert condition_holds(expr, f"{ZONE}/disks/{n}", DISK)
    for n in (head_name("demo"), instance_name("demo-x", "r", 0), "demo",
              "other-" + instance_name("demo", "r", 0), instance_name("demo-1", "r", 1)):  # fmt: skip
        assert not condition_holds(expr, f"{ZONE}/instances/{n}", VM), n
        assert not condition_holds(expr, f"{ZONE}/disks/{n}", DISK), n
    assert condition_holds(expr, f"projects/{PROJECT}",
                           "cloudresourcemanager.googleapis.com/Project")
    # another region's zone, another project's
    n = instance_name("demo", "r", 0)
    assert not condition_holds(expr, f"projects/{PROJECT}/zones/us-east1-b/instances/{n}", VM)
    assert not condition_holds(expr, f"projects/other/zones/us-central1-a/instances/{n}", VM)


def test_up_brings_the_heads_role_back_and_in_step(fake: Any, spotctl_home: Path) -> None:
    """The custom role outlives `down` (other clusters' heads may hold it); an `up` after
    someone deleted it (IAM keeps a deleted role, and its id, for a while) undeletes it,
    and one after someone widened or narrowed it sets it back."""
    p = get_provider("gcp", make_ctx(fake, spotctl_home))
    p.prepare()
    role = fake.storage.roles[p.head_role]
    assert p.cleanup() == [] and not role["deleted"]  # kept by down
    role["deleted"] = True
    p.prepare()
    assert not fake.storage.roles[p.head_role]["deleted"]
    fake.storage.roles[p.head_role]["includedPermissions"] = ["compute.instances.setTags"]
    p.prepare()
    assert sorted(fake.storage.roles[p.head_role]["includedPermissions"]) == sorted(
        HEAD_PERMISSIONS)
    assert p.cleanup() == []
    assert gcp_leftovers(fake) == GCP_NOTHING
