"""docs/getting-started/gcp.md: `templates/gcp-roles.txt` lists the permissions spotctl needs. Run a whole
provider lifecycle (down with a purge) against the fake Compute, Storage and IAM server, map every REST call it made to the
IAM permissions Compute checks for it, and compare with the list both ways."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .fake_compute import ROUTES
from .fake_storage import STORAGE_ROUTES

pytestmark = pytest.mark.gcp

REPO = Path(__file__).resolve().parents[2]
# REST method -> the permissions Compute Engine checks for it (insert also checks the
# resources the instance references: boot disk, image, subnetwork, external IP, and the
# metadata/labels/tags it is created with; a firewall rule updates its network's policy).
PERMISSIONS: dict[str, set[str]] = {
    "instances.insert": {
        "compute.instances.create", "compute.disks.create", "compute.images.useReadOnly",
        "compute.subnetworks.use", "compute.subnetworks.useExternalIp",
        "compute.instances.setMetadata", "compute.instances.setLabels",
        "compute.instances.setServiceAccount", "iam.serviceAccounts.actAs",
        "compute.resourcePolicies.use",  # a compact placement policy named by the VM
        # (compute.instances.setTags too, for a VM created with network tags: spotctl's
        # have none, the firewall rules pick them by service account)
    },
    "instances.list": {"compute.instances.list"},
    "instances.aggregatedList": {"compute.instances.list"},
    "instances.get": {"compute.instances.get"},
    "instances.getGuestAttributes": {"compute.instances.getGuestAttributes"},
    "instances.delete": {"compute.instances.delete"},
    "zoneOperations.get": {"compute.zoneOperations.get"},
    "zoneOperations.wait": {"compute.zoneOperations.get"},
    "globalOperations.get": {"compute.globalOperations.get"},
    "globalOperations.wait": {"compute.globalOperations.get"},
    "images.get": {"compute.images.get"},
    "images.getFromFamily": {"compute.images.getFromFamily"},
    "regions.get": {"compute.regions.get"},
    "projects.get": {"compute.projects.get"},
    "networks.get": {"compute.networks.get"},
    # the cluster's subnetwork (`check`) and the head's networkUser binding on it
    "subnetworks.get": {"compute.subnetworks.get"},
    "subnetworks.getIamPolicy": {"compute.subnetworks.getIamPolicy"},
    "subnetworks.setIamPolicy": {"compute.subnetworks.setIamPolicy"},
    "firewalls.insert": {"compute.firewalls.create", "compute.networks.updatePolicy"},
    "firewalls.list": {"compute.firewalls.list"},
    "firewalls.get": {"compute.firewalls.get"},
    "firewalls.delete": {"compute.firewalls.delete", "compute.networks.updatePolicy"},
    # compact placement policies (regional) and waiting on their operations
    "resourcePolicies.insert": {"compute.resourcePolicies.create"},
    "resourcePolicies.get": {"compute.resourcePolicies.get"},
    "resourcePolicies.list": {"compute.resourcePolicies.list"},
    "resourcePolicies.delete": {"compute.resourcePolicies.delete"},
    "resourcePolicies.getIamPolicy": {"compute.resourcePolicies.getIamPolicy"},
    "resourcePolicies.setIamPolicy": {"compute.resourcePolicies.setIamPolicy"},
    "regionOperations.get": {"compute.regionOperations.get"},
    "regionOperations.wait": {"compute.regionOperations.get"},
    # checkpoint bucket, the workers' service account and its bucket bindings (storage.py)
    "storage.buckets.insert": {"storage.buckets.create"},
    "storage.buckets.get": {"storage.buckets.get"},
    "storage.buckets.delete": {"storage.buckets.delete"},
    "storage.buckets.getIamPolicy": {"storage.buckets.getIamPolicy"},
    "storage.buckets.setIamPolicy": {"storage.buckets.setIamPolicy"},
    "storage.objects.list": {"storage.objects.list"},
    "storage.objects.get": {"storage.objects.get"},
    "storage.objects.delete": {"storage.objects.delete"},
    "storage.objects.insert": {"storage.objects.create"},
    "storage.objects.move": {"storage.objects.get", "storage.objects.create",
                             "storage.objects.delete"},
    "storage.objects.rewrite": {"storage.objects.get", "storage.objects.create"},
    "storage.objects.compose": {"storage.objects.get", "storage.objects.create"},
    "iam.serviceAccounts.create": {"iam.serviceAccounts.create"},
    "iam.serviceAccounts.get": {"iam.serviceAccounts.get"},
    "iam.serviceAccounts.delete": {"iam.serviceAccounts.delete"},
    # the head's account ([rebalance] on_head): its project bindings, and the right to run
    # workers as the workers' account (a binding on that account)
    "iam.serviceAccounts.getIamPolicy": {"iam.serviceAccounts.getIamPolicy"},
    "iam.serviceAccounts.setIamPolicy": {"iam.serviceAccounts.setIamPolicy"},
    # the project's custom role for heads (made once, kept by `down`)
    "iam.roles.create": {"iam.roles.create"},
    "iam.roles.get": {"iam.roles.get"},
    "iam.roles.update": {"iam.roles.update"},
    "iam.roles.undelete": {"iam.roles.undelete"},
    "iam.roles.delete": {"iam.roles.delete"},
    "cloudresourcemanager.projects.getIamPolicy": {"resourcemanager.projects.getIamPolicy"},
    "cloudresourcemanager.projects.setIamPolicy": {"resourcemanager.projects.setIamPolicy"},
    "cloudresourcemanager.projects.getEffectiveOrgPolicy": {"orgpolicy.policy.get"},
}  # fmt: skip


def _roles() -> set[str]:
    lines = (REPO / "templates" / "gcp-roles.txt").read_text().splitlines()
    return {ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")}


def test_every_call_of_a_lifecycle_is_covered_by_the_role_list(fake: Any, provider: Any) -> None:
    provider.prepare()  # key, firewall rules, bucket, service account
    # a checkpoint object under the cluster's prefix, so the purge lists and deletes
    fake.storage.objects[provider.bucket_name()]["demo/checkpoints/x"] = (b"", {"name": "x"})
    offer = next(o for o in provider.offers() if o.gpus == 1)
    head = provider.ensure_head()
    got = provider.launch(offer, 2, "req-roles")
    assert len(provider.list(provider.ctx.cluster)) >= 2
    provider.terminate([i.id for i in got] + [head.instance_id])
    provider.ctx.options["purge"] = True
    provider.cleanup()
    made = {r.key for r in fake.requests if r.key}
    assert {"instances.insert", "instances.delete", "firewalls.insert",
            "storage.buckets.setIamPolicy", "storage.objects.delete",
            "cloudresourcemanager.projects.setIamPolicy"} <= made, made
    unknown = made - PERMISSIONS.keys()
    assert not unknown, f"calls with no known permission (add them here): {unknown}"
    needed = set().union(*(PERMISSIONS[k] for k in made))
    assert needed <= _roles(), f"missing from templates/gcp-roles.txt: {sorted(needed - _roles())}"


def test_the_role_list_asks_for_nothing_no_call_needs() -> None:
    served = {key for _, key, _ in ROUTES + STORAGE_ROUTES}
    assert served <= PERMISSIONS.keys(), served - PERMISSIONS.keys()
    possible = set().union(*(PERMISSIONS[k] for k in served))
    extra = _roles() - possible
    assert not extra, f"templates/gcp-roles.txt grants what no call spotctl makes needs: {extra}"
