"""The GCP head's own account ([rebalance] on_head): what `up` grants it, what its loop
calls, and that `down` takes it all away. On the fake Compute, Storage and IAM server.

GCP scopes the head's custom role with an IAM condition on resource names (Compute has no
label conditions). The fake refuses a condition that calls a function IAM does not offer
(as IAM does: `matches` is CEL's, not IAM's) and evaluates the ones it can read
(tests/gcp/fake_iam.py); test_head_scope.py runs the head's loop as its account."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotctl.providers import get_provider
from spotctl.providers.gcp import placement
from spotctl.providers.gcp.launch import HEAD_POLICY_ROLE
from spotctl.providers.gcp.storage import ACT_AS_ROLE, HEAD_NET_ROLE, HEAD_PERMISSIONS

from .conftest import GCP_NOTHING, PROJECT, gcp_leftovers, make_ctx
from .fake_iam import condition_holds
from .test_roles_claim import PERMISSIONS

pytestmark = pytest.mark.gcp

# what the head's other grants give of what spotctl calls: networkUser on the cluster's
# subnetwork, serviceAccountUser on the workers' account, the use of the cluster's
# placement policies (on each policy), and public images (anyone may read and use them)
HEAD_MAY_ELSEWHERE = {
    "compute.subnetworks.use", "compute.subnetworks.useExternalIp",
    "iam.serviceAccounts.actAs", "compute.resourcePolicies.use",
    "compute.images.useReadOnly", "compute.images.get", "compute.images.getFromFamily",
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
    # project: the custom role under the condition; the subnetwork: networkUser
    got = _bindings(fake, f"projects/{PROJECT}", member)
    assert [b["role"] for b in got] == [ctl.head_role], got
    expr = got[0]["condition"]["expression"]
    assert expr == ctl.head_condition()["expression"]
    assert sorted(fake.storage.roles[ctl.head_role]["includedPermissions"]) == sorted(
        HEAD_PERMISSIONS)
    assert [b["role"] for b in fake.subnet_iam[("us-central1", "default")]["bindings"]
            if member in b["members"]] == [HEAD_NET_ROLE]  # fmt: skip
    # the workers' account: the head may run VMs as it, and as no other account
    assert [b["role"] for b in _bindings(fake, f"serviceAccounts/{ctl.node_account}",
                                         member)] == [ACT_AS_ROLE]  # fmt: skip
    assert [r for r, pol in fake.storage.iam_policies.items() if any(
        member in b.get("members", []) for b in pol["bindings"])] == [
        f"projects/{PROJECT}", f"serviceAccounts/{ctl.node_account}"]  # fmt: skip
    vm, disk = "compute.googleapis.com/Instance", "compute.googleapis.com/Disk"
    zone = f"projects/{PROJECT}/zones/us-central1-a"

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
    needed = set().union(*(PERMISSIONS[k] for k in calls))
    beyond = needed - set(HEAD_PERMISSIONS) - HEAD_MAY_ELSEWHERE
    assert not beyond, f"the head's loop needs what its roles do not give: {beyond}"
    # the conditional permissions were used on this cluster's VM (and its boot disk) only
    name = ins.body["name"]
    assert condition_holds(expr, f"{zone}/instances/{name}", vm), name
    assert condition_holds(expr, f"{zone}/disks/{name}", disk), name
    assert ins.body["serviceAccounts"][0]["email"] == ctl.node_account

    # down: the head's bindings and account go with the rest
    assert ctl.cleanup() == []
    assert gcp_leftovers(fake) == GCP_NOTHING


def test_without_on_head_the_project_policy_is_never_touched(
    fake: Any, spotctl_home: Path
) -> None:
    """[rebalance] on_head = false: the head's account holds no role, and neither `up`
    nor `down` reads or writes an IAM policy of the project, a subnetwork or an account
    for it, nor makes a custom role (a role without those permissions works)."""
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
    # its own account (the firewall rules pick the cluster's VMs by account), with no
    # scope: its VM gets no API token
    assert ins.body["serviceAccounts"] == [{"email": p.head_account}], ins.body
    assert p.cleanup() == []
    touched = {r.key for r in fake.requests if r.key and ("IamPolicy" in r.key
               or r.key.startswith("iam.roles.")) and not r.key.startswith("storage.")}
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


def test_a_policy_changed_by_someone_else_meanwhile_is_read_again(
        fake: Any, spotctl_home: Path) -> None:
    """IAM's read-modify-write: a setIamPolicy whose etag another writer has made stale is
    refused (the project's 409 ABORTED, the subnetwork's 412); spotctl reads the policy
    again and puts its binding in beside the other writer's, which stays."""
    ctl = get_provider("gcp", make_ctx(fake, spotctl_home))
    ctl.prepare()
    other = "user:someone@example.com"
    raced: list[str] = []
    real_proj, real_subnet = fake.storage._projects_setIamPolicy, fake._subnetworks_setIamPolicy

    def projects_set(project: str, body: Any, **kw: Any) -> Any:
        if "project" not in raced:  # another writer gets in between the read and the write
            raced.append("project")
            pol = fake.storage._policy_of(f"projects/{project}")
            real_proj(project, {"policy": dict(pol, bindings=[
                *pol.get("bindings", []), {"role": "roles/viewer", "members": [other]}])})
        return real_proj(project, body, **kw)

    def subnet_set(project: str, region: str, name: str, body: Any, **kw: Any) -> Any:
        if "subnet" not in raced:
            raced.append("subnet")
            pol = fake.subnet_iam.get((region, name)) or {"etag": "BwX0"}
            real_subnet(project, region, name, {"policy": dict(pol, bindings=[
                *pol.get("bindings", []), {"role": "roles/compute.networkViewer",
                                           "members": [other]}])})
        return real_subnet(project, region, name, body, **kw)

    fake.storage._projects_setIamPolicy = projects_set
    fake._subnetworks_setIamPolicy = subnet_set
    ctl.ensure_head()
    assert sorted(raced) == ["project", "subnet"], raced
    member = f"serviceAccount:{ctl.head_account}"
    assert [b["role"] for b in _bindings(fake, f"projects/{PROJECT}", member)] == [ctl.head_role]
    assert _bindings(fake, f"projects/{PROJECT}", other)  # the other writer's, kept
    sub = fake.subnet_iam[("us-central1", "default")]["bindings"]
    assert [b["role"] for b in sub if member in b["members"]] == [HEAD_NET_ROLE]
    assert [b["role"] for b in sub if other in b["members"]] == ["roles/compute.networkViewer"]
