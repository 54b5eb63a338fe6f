"""The GCP head's own account ([rebalance] on_head): what `up` grants it, what its loop
calls, and that `down` takes it all away. On the fake Compute, Storage and IAM server.

GCP scopes the head's instance-admin role with an IAM condition on resource names (Compute
has no label conditions). The fake refuses a condition that calls a function IAM does not
offer (as IAM does: `matches` is CEL's, not IAM's) but does not evaluate Compute's
conditions, so `_condition_grants` below evaluates this one the way IAM documents it (the
resource's type and full name; `extract` takes what follows the template's literal)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from spotctl.providers import get_provider
from spotctl.providers.gcp import placement
from spotctl.providers.gcp.api import head_name, instance_name
from spotctl.providers.gcp.launch import HEAD_POLICY_ROLE
from spotctl.providers.gcp.storage import ACT_AS_ROLE, HEAD_NET_ROLE, HEAD_READ_ROLE, HEAD_ROLE

from .conftest import GCP_NOTHING, PROJECT, gcp_leftovers, make_ctx
from .test_roles_claim import PERMISSIONS

pytestmark = pytest.mark.gcp

# what the head's unconditional roles give of what spotctl calls: roles/compute.viewer
# (reads), roles/compute.networkUser (a VM on a subnetwork, with an external address),
# public images (anyone may use them) and roles/iam.serviceAccountUser (the workers' account)
HEAD_MAY_ANYWHERE = {
    "compute.instances.get", "compute.instances.list", "compute.images.useReadOnly",
    "compute.images.get", "compute.images.getFromFamily", "compute.subnetworks.use",
    "compute.subnetworks.useExternalIp", "compute.networks.get", "compute.zoneOperations.get",
    "compute.regionOperations.get", "compute.regions.get", "compute.projects.get",
    "compute.resourcePolicies.get", "compute.resourcePolicies.list",
    "iam.serviceAccounts.actAs",
}  # fmt: skip
# what roles/compute.instanceAdmin.v1 gives under the condition: on its VMs and disks only
HEAD_MAY_ON_ITS_OWN = {
    "compute.instances.create", "compute.instances.delete", "compute.instances.setMetadata",
    "compute.instances.setLabels", "compute.instances.setTags",
    "compute.instances.getGuestAttributes", "compute.disks.create",
}  # fmt: skip
_TERM = re.compile(r'\(resource\.type == "([^"]+)" && resource\.name\.extract\("([^"{]+)\{name\}"\)'
                   r'\.startsWith\("([^"]+)"\)\)')


def _condition_grants(expr: str, type_: str, name: str) -> bool:
    """The head's condition for a resource of `type_` and full name `name`."""
    terms = expr.split(" || ")
    parsed = [_TERM.fullmatch(t) for t in terms]
    assert all(parsed), f"not a condition this test can read: {expr}"
    for m in parsed:
        assert m is not None
        want_type, lead, prefix = m.groups()
        if type_ == want_type and lead in name and name.split(lead, 1)[1].startswith(prefix):
            return True
    return False


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
    # project: read Compute, use its subnetworks, and instance admin under the condition
    got = {b["role"]: b for b in _bindings(fake, f"projects/{PROJECT}", member)}
    assert set(got) == {HEAD_READ_ROLE, HEAD_NET_ROLE, HEAD_ROLE}, got
    assert "condition" not in got[HEAD_READ_ROLE]
    expr = got[HEAD_ROLE]["condition"]["expression"]
    assert expr == ctl.head_condition()["expression"]
    assert "condition" not in got[HEAD_NET_ROLE]
    # the workers' account: the head may run VMs as it, and as no other account
    assert [b["role"] for b in _bindings(fake, f"serviceAccounts/{ctl.node_account}",
                                         member)] == [ACT_AS_ROLE]  # fmt: skip
    assert [r for r, pol in fake.storage.iam_policies.items() if any(
        member in b.get("members", []) for b in pol["bindings"])] == [
        f"projects/{PROJECT}", f"serviceAccounts/{ctl.node_account}"]  # fmt: skip

    # the condition's names: this cluster's workers and their disks, not its head, not
    # other clusters' (demo-x, demo-abcdef12, a name that only contains a worker's)
    vm, disk = "compute.googleapis.com/Instance", "compute.googleapis.com/Disk"
    zone = f"projects/{PROJECT}/zones/us-central1-a"
    mine = [instance_name("demo", f"req-{i}", i) for i in range(3)]
    for n in mine:
        assert _condition_grants(expr, vm, f"{zone}/instances/{n}"), (expr, n)
        assert _condition_grants(expr, disk, f"{zone}/disks/{n}"), (expr, n)
    others = [head_name("demo"), instance_name("demo-x", "req-1", 0), "demo",
              "other-" + mine[0], instance_name("demo-abcdef12", "r", 1),
              instance_name("demo-1", "r", 1)]  # fmt: skip
    for n in others:
        for t, kind in ((vm, "instances"), (disk, "disks")):
            assert not _condition_grants(expr, t, f"{zone}/{kind}/{n}"), (expr, n)
    # nothing but VMs and disks: not a firewall, an image or a resource policy named so
    assert not _condition_grants(expr, "compute.googleapis.com/Firewall",
                                 f"projects/{PROJECT}/global/firewalls/{mine[0]}")
    assert not _condition_grants(expr, "compute.googleapis.com/ResourcePolicy",
                                 f"projects/{PROJECT}/regions/us-central1/"
                                 f"resourcePolicies/{mine[0]}")  # fmt: skip

    # the head's loop (head mode): what it calls is within the two roles, and makes no
    # firewall, bucket, account or binding
    n = len(fake.requests)
    ctx = make_ctx(fake, spotctl_home)
    ctx.options["on_head"] = head.instance_id
    on = get_provider("gcp", ctx)
    on.prepare()
    assert on.ensure_head().instance_id == head.instance_id
    # an L4 (g2): the controller puts it in the cluster's compact placement policy
    offer = next(o for o in on.offers() if o.gpus == 1 and o.instance_type.startswith("g2-"))
    ctl.launch(offer, 1, "req-ctl")
    assert [r.body.get("resourcePolicies") for r in fake.requests[n:]
            if r.key == "instances.insert"] != [None], "the controller used no placement policy"
    n = len(fake.requests)
    (new,) = on.launch(offer, 1, "req-head")
    assert new.id in {i.id for i in on.list("demo")}
    on.guest_host_keys(new.zone, new.id)
    on.terminate([new.id])
    calls = {r.key for r in fake.requests[n:] if r.key}
    assert "instances.insert" in calls and "instances.delete" in calls, calls
    [ins] = [r for r in fake.requests[n:] if r.key == "instances.insert"]
    # compact placement from the head too, as `up` gives it: the zone's policy the
    # controller made (the head makes none), which `up` let the head's account use by a
    # binding on that policy alone (its own IAM policy, not the project's)
    url = (f"projects/{PROJECT}/regions/us-central1/resourcePolicies/"
           f"{placement.policy_name('demo', offer.zone)}")
    assert ins.body.get("resourcePolicies") == [url], ins.body
    assert ins.body["labels"][placement.LABEL_NETWORK] == "gvnic-compact"
    assert not [c for c in calls if c.startswith("resourcePolicies.")
                and c != "resourcePolicies.get"], calls
    (grant,) = fake.policy_iam.values()
    assert [b for b in grant["bindings"] if member in b["members"]] == [
        {"role": HEAD_POLICY_ROLE, "members": [member]}]
    needed = set().union(*(PERMISSIONS[k] for k in calls)) - {"compute.resourcePolicies.use"}
    beyond = needed - HEAD_MAY_ANYWHERE - HEAD_MAY_ON_ITS_OWN
    assert not beyond, f"the head's loop needs what its roles do not give: {beyond}"
    # the conditional permissions were used on this cluster's VM (and its boot disk) only
    name = ins.body["name"]
    assert _condition_grants(expr, vm, f"{zone}/instances/{name}"), name
    assert _condition_grants(expr, disk, f"{zone}/disks/{name}"), name
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


def test_a_condition_iam_cannot_evaluate_is_refused(
    fake: Any, spotctl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IAM Conditions offer startsWith/endsWith/extract on resource names, not CEL's regex
    `matches`: a policy that calls it is refused (the head's first condition did, and `up`
    would have stopped there on a real project). The fake refuses it as IAM does."""
    from spotctl.errors import ProviderError
    from spotctl.providers.gcp.storage import GcpStorage

    ctl = get_provider("gcp", make_ctx(fake, spotctl_home))
    ctl.prepare()
    regex = {"title": "t", "expression":
             'resource.name.extract("/instances/{name}").matches("^demo-[0-9a-f]{8}-[0-9]+$")'}
    monkeypatch.setattr(GcpStorage, "head_condition", lambda self: regex)
    with pytest.raises(ProviderError, match="undeclared reference to 'matches'"):
        ctl.ensure_head()


def test_an_identity_that_may_not_set_the_projects_policy_is_told_what_to_do(
    fake: Any, spotctl_home: Path
) -> None:
    """Many identities may create VMs but not set the project's IAM policy (no Project
    IAM Admin): `up` with on_head (the default) stops at the head's bindings, and its one
    line says which permission that is and that on_head = false avoids it."""
    from spotctl.errors import AuthError

    fake.storage.project_iam_admin = False
    ctl = get_provider("gcp", make_ctx(fake, spotctl_home))
    with pytest.raises(AuthError, match=r"Policy update access denied.*on_head = false") as e:
        ctl.prepare()
    assert "resourcemanager.projects.setIamPolicy" in str(e.value)
    assert "\n" not in str(e.value)
    assert ctl.cleanup() == []
    assert gcp_leftovers(fake) == GCP_NOTHING
