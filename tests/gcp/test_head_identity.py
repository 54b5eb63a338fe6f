"""The GCP head's own account ([rebalance] on_head): what `up` grants it, what its loop
calls, and that `down` takes it all away. On the fake Compute, Storage and IAM server.

GCP scopes the head's instance-admin role with an IAM condition on resource names (Compute
has no label conditions). The fake does not evaluate CEL, so the condition is checked as
a document: its name pattern is applied (with Python's re, which agrees with RE2 on it) to
this cluster's worker names and to other clusters' names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from spotctl.providers import get_provider
from spotctl.providers.gcp.api import head_name, instance_name
from spotctl.providers.gcp.storage import ACT_AS_ROLE, HEAD_READ_ROLE, HEAD_ROLE

from .conftest import GCP_NOTHING, PROJECT, gcp_leftovers, make_ctx
from .test_roles_claim import PERMISSIONS

pytestmark = pytest.mark.gcp

# what roles/compute.viewer and roles/compute.instanceAdmin.v1 grant of what spotctl calls
HEAD_MAY = {
    "compute.instances.create", "compute.instances.get", "compute.instances.list",
    "compute.instances.delete", "compute.instances.setMetadata", "compute.instances.setLabels",
    "compute.instances.setTags", "compute.instances.getGuestAttributes",
    "compute.disks.create", "compute.images.useReadOnly", "compute.images.get",
    "compute.images.getFromFamily", "compute.subnetworks.use",
    "compute.subnetworks.useExternalIp", "compute.networks.get", "compute.zoneOperations.get",
    "compute.regionOperations.get", "compute.regions.get", "compute.projects.get",
    "compute.resourcePolicies.get", "compute.resourcePolicies.list",
    "compute.resourcePolicies.use", "compute.resourcePolicies.create",
    "iam.serviceAccounts.actAs",
}  # fmt: skip


def _bindings(fake: Any, resource: str, member: str) -> list[dict[str, Any]]:
    pol = fake.storage.iam_policies.get(resource, {})
    return [b for b in pol.get("bindings", []) if member in b.get("members", [])]


def test_the_heads_account_its_scope_its_calls_and_its_end(fake: Any, spotctl_home: Path) -> None:
    ctl = get_provider("gcp", make_ctx(fake, spotctl_home))
    assert ctl.ctx.spec.head_rebalances
    ctl.prepare()
    head = ctl.ensure_head()
    member = f"serviceAccount:{ctl.head_account}"
    assert ctl.head_account in fake.storage.service_accounts
    assert ctl.head_account != ctl.node_account
    # project: read Compute, and instance admin under the condition
    got = {b["role"]: b for b in _bindings(fake, f"projects/{PROJECT}", member)}
    assert set(got) == {HEAD_READ_ROLE, HEAD_ROLE}, got
    assert "condition" not in got[HEAD_READ_ROLE]
    expr = got[HEAD_ROLE]["condition"]["expression"]
    assert expr == ctl.head_condition()["expression"]
    # the workers' account: the head may run VMs as it, and as no other account
    assert [b["role"] for b in _bindings(fake, f"serviceAccounts/{ctl.node_account}",
                                         member)] == [ACT_AS_ROLE]  # fmt: skip
    assert [r for r, pol in fake.storage.iam_policies.items() if any(
        member in b.get("members", []) for b in pol["bindings"])] == [
        f"projects/{PROJECT}", f"serviceAccounts/{ctl.node_account}"]  # fmt: skip

    # the condition's names: this cluster's workers, not its head, not other clusters'
    [vm_re] = set(re.findall(r'extract\("/(?:instances|disks)/\{name\}"\)\.matches\("([^"]+)"\)',
                             expr))
    mine = [instance_name("demo", f"req-{i}", i) for i in range(3)]
    others = [head_name("demo"), instance_name("demo-x", "req-1", 0), "demo",
              instance_name("demo", "r", 0) + "-0", "other-" + mine[0],
              instance_name("demo-abcdef12", "r", 1)]  # fmt: skip
    assert all(re.search(vm_re, n) for n in mine), (vm_re, mine)
    assert not [n for n in others if re.search(vm_re, n)], (vm_re, others)
    assert 'resource.type == "compute.googleapis.com/Subnetwork"' in expr
    assert 'startsWith("spotctl-demo-")' in expr  # its compact placement policies

    # the head's loop (head mode): what it calls is within the two roles, and makes no
    # firewall, bucket, account or binding
    n = len(fake.requests)
    ctx = make_ctx(fake, spotctl_home)
    ctx.options["on_head"] = head.instance_id
    on = get_provider("gcp", ctx)
    on.prepare()
    assert on.ensure_head().instance_id == head.instance_id
    offer = next(o for o in on.offers() if o.gpus == 1)
    (new,) = on.launch(offer, 1, "req-head")
    assert new.id in {i.id for i in on.list("demo")}
    on.guest_host_keys(new.zone, new.id)
    on.terminate([new.id])
    calls = {r.key for r in fake.requests[n:] if r.key}
    assert "instances.insert" in calls and "instances.delete" in calls, calls
    needed = set().union(*(PERMISSIONS[k] for k in calls))
    assert needed <= HEAD_MAY, f"the head's loop needs what its roles do not give: {needed - HEAD_MAY}"
    [ins] = [r for r in fake.requests[n:] if r.key == "instances.insert"]
    assert re.search(vm_re, ins.body["name"]), ins.body["name"]
    assert ins.body["serviceAccounts"][0]["email"] == ctl.node_account

    # down: the head's bindings and account go with the rest
    assert ctl.cleanup() == []
    assert gcp_leftovers(fake) == GCP_NOTHING


def test_without_on_head_the_project_policy_is_never_touched(
    fake: Any, spotctl_home: Path
) -> None:
    """[rebalance] on_head = false: no head account, and neither `up` nor `down` reads or
    writes the project's IAM policy (a role without those permissions works)."""
    import dataclasses

    from spotctl.spec import ClusterSpec

    ctx = make_ctx(fake, spotctl_home)
    spec = ClusterSpec.model_validate({**ctx.spec.model_dump(mode="json"),
                                       "rebalance": {"on_head": False}})  # fmt: skip
    p = get_provider("gcp", dataclasses.replace(ctx, spec=spec))
    p.prepare()
    head = p.ensure_head()
    p.launch(next(o for o in p.offers() if o.gpus == 1), 1, "req-off")
    [ins] = [r for r in fake.requests if r.key == "instances.insert"
             and r.body["name"] == head.instance_id]
    assert not ins.body.get("serviceAccounts"), ins.body
    assert p.cleanup() == []
    touched = {r.key for r in fake.requests if r.key and "IamPolicy" in r.key
               and not r.key.startswith("storage.")}
    assert touched == set(), touched
    assert gcp_leftovers(fake) == GCP_NOTHING


def test_down_deletes_a_vm_the_head_launched_while_it_listed(
    fake: Any, spotctl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head's loop can be mid-launch when `down` lists the cluster: that VM appears
    after the list, and down deletes it too instead of leaving it billing."""
    from spotctl.providers.gcp.provider import GcpProvider

    p = get_provider("gcp", make_ctx(fake, spotctl_home))
    p.prepare()
    head = p.ensure_head()
    offer = next(o for o in p.offers() if o.gpus == 1)
    p.launch(offer, 1, "req-1")
    ctx = make_ctx(fake, spotctl_home)
    ctx.options["on_head"] = head.instance_id
    on = get_provider("gcp", ctx)
    real = GcpProvider._delete
    late: list[str] = []

    def delete(self: Any, names: Any) -> Any:
        names = list(names)
        if not late:  # the head's launch lands just after down's list
            late.extend(i.id for i in on.launch(offer, 1, "req-late"))
        return real(self, names)

    monkeypatch.setattr(GcpProvider, "_delete", delete)
    assert p.cleanup() == []
    assert late and gcp_leftovers(fake) == GCP_NOTHING
