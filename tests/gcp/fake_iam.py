"""IAM's authorization of Compute Engine calls, for the fake GCP server (fake_compute.py).

A request with `Authorization: Bearer <token>` acts as the service account the token was
issued to (fake_storage.FakeStorage.issue_token, or a fake VM's metadata server); it is
checked here before the fake serves it. Anonymous requests act as the project's owner
(spotctl's own calls against a test endpoint), as in fake_storage.py.

What each call needs, on which resource (Compute Engine API reference, "IAM permissions"
of each method; "Create a VM that uses a user-managed service account",
cloud.google.com/compute/docs/access/create-enable-service-accounts-for-instances,
"Required permissions"):
- instances.insert: compute.instances.create on the VM; compute.disks.create on each disk
  it creates (named after the VM unless initializeParams.diskName says otherwise);
  compute.instances.setMetadata / setLabels / setTags / setServiceAccount on the VM when
  it is created with metadata / labels / network tags / a service account;
  compute.subnetworks.use on the subnetwork of each NIC (the one named, or the region's
  subnetwork of an auto-mode network named alone) and compute.subnetworks.useExternalIp
  there for an access config; compute.resourcePolicies.use on each resource policy;
  compute.images.useReadOnly on an image of the project (public images are granted to
  every authenticated user by their projects); and iam.serviceAccounts.actAs on the VM's
  account, refused as Compute refuses it: 400, "The user does not have access to service
  account ...".
- instances.get / delete / getGuestAttributes: that permission on the VM.
- instances.list / aggregatedList, zone / region / global operations: checked on the
  project: a condition on a VM's name never sees a VM there.
- anything else: compute.<resource>.<verb> on the project (insert -> create, wait -> get).

Where a permission comes from: the project's IAM policy (fake_storage's `iam_policies`),
and for a subnetwork, a resource policy or a service account also that resource's own IAM
policy. A binding grants its role's permissions (PREDEFINED below, or the project's custom
role as created through IAM's roles API) where its condition holds for the resource's name
and type (IAM, "Resource attributes for IAM Conditions": `projects/P/zones/Z/instances/N`,
`compute.googleapis.com/Instance`). A refusal is Compute's 403: reason `forbidden`, message
"Required '<permission>' permission for '<resource>'".

Conditions: terms joined by `||` and `&&` (with parentheses) of `resource.type ==` / `!=`
"...", `resource.name.startsWith("...")` and `resource.name.extract("<lead>{name}")
.startsWith("...")` (extract: what follows the first occurrence of the lead, "" without
one; IAM, "Attribute reference for IAM Conditions", extract()). Anything else is an
error, never a grant.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fake_compute import FakeCompute

# The permissions of the predefined roles spotctl grants or granted, as far as the calls
# the fake serves need them (IAM, "Compute Engine roles and permissions").
_READ = {"compute.instances.get", "compute.instances.list", "compute.zoneOperations.get",
         "compute.regionOperations.get", "compute.globalOperations.get", "compute.images.get",
         "compute.images.getFromFamily", "compute.resourcePolicies.get",
         "compute.resourcePolicies.list", "compute.subnetworks.get", "compute.networks.get",
         "compute.regions.get", "compute.projects.get", "compute.firewalls.list"}  # fmt: skip
PREDEFINED: dict[str, set[str]] = {
    "roles/compute.viewer": _READ,
    "roles/compute.instanceAdmin.v1": _READ - {"compute.firewalls.list"} | {
        "compute.instances.create", "compute.instances.delete",
        "compute.instances.getGuestAttributes", "compute.instances.setMetadata",
        "compute.instances.setLabels", "compute.instances.setTags",
        "compute.instances.setServiceAccount", "compute.disks.create",
        "compute.images.useReadOnly", "compute.resourcePolicies.use",
        "compute.subnetworks.use", "compute.subnetworks.useExternalIp"},
    "roles/compute.networkUser": {"compute.subnetworks.use", "compute.subnetworks.useExternalIp",
                                  "compute.subnetworks.get", "compute.networks.get",
                                  "compute.networks.use"},
    "roles/iam.serviceAccountUser": {"iam.serviceAccounts.actAs", "iam.serviceAccounts.get"},
}  # fmt: skip

PROJECT_TYPE = "cloudresourcemanager.googleapis.com/Project"
_TOKEN = re.compile(r'\s*(\(|\)|&&|\|\||resource\.type\s*(==|!=)\s*"([^"]*)"'
                    r'|resource\.name(?:\.extract\("([^"]*)"\))?\.startsWith\("([^"]*)"\))')


class ConditionError(Exception):
    """A condition the fake cannot evaluate (it never guesses a grant)."""


def extract(name: str, template: str) -> str:
    """IAM's resource.name.extract(template) for a template "<lead>{name}<tail>"."""
    lead, _, tail = template.partition("{name}")
    if lead not in name:
        return ""
    rest = name.split(lead, 1)[1]
    if tail:
        if tail not in rest:
            return ""
        rest = rest.split(tail, 1)[0]
    return rest


def condition_holds(expression: str, name: str, type_: str) -> bool:
    """Evaluate an IAM condition of the subset above for a resource."""
    tokens: list[tuple[str, bool]] = []  # ("(", ")", "&&", "||") or ("v", value)
    pos, text = 0, expression.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ConditionError(f"the fake cannot evaluate {text[pos:]!r} in {expression!r}")
        pos = m.end()
        if m.group(1) in ("(", ")", "&&", "||"):
            tokens.append((m.group(1), False))
        elif m.group(2):
            tokens.append(("v", (type_ == m.group(3)) == (m.group(2) == "==")))
        else:
            subject = extract(name, m.group(4)) if m.group(4) is not None else name
            tokens.append(("v", subject.startswith(m.group(5))))
        while pos < len(text) and text[pos].isspace():
            pos += 1

    def parse_or(i: int) -> tuple[bool, int]:
        v, i = parse_and(i)
        while i < len(tokens) and tokens[i][0] == "||":
            w, i = parse_and(i + 1)
            v = v or w
        return v, i

    def parse_and(i: int) -> tuple[bool, int]:
        v, i = parse_atom(i)
        while i < len(tokens) and tokens[i][0] == "&&":
            w, i = parse_atom(i + 1)
            v = v and w
        return v, i

    def parse_atom(i: int) -> tuple[bool, int]:
        if i >= len(tokens):
            raise ConditionError(f"incomplete condition {expression!r}")
        kind, val = tokens[i]
        if kind == "(":
            v, i = parse_or(i + 1)
            if i >= len(tokens) or tokens[i][0] != ")":
                raise ConditionError(f"unbalanced condition {expression!r}")
            return v, i + 1
        if kind != "v":
            raise ConditionError(f"unexpected {kind!r} in {expression!r}")
        return val, i + 1

    value, end = parse_or(0)
    if end != len(tokens):
        raise ConditionError(f"trailing terms in {expression!r}")
    return value


class Refused(Exception):
    """Compute's answer to a call IAM does not allow."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def _verb_permission(key: str) -> str:
    resource, _, verb = key.partition(".")
    verb = {"insert": "create", "wait": "get", "aggregatedList": "list"}.get(verb, verb)
    return f"compute.{resource}.{verb}"


class ComputeIam:
    """The authorization of one fake's Compute calls."""

    def __init__(self, compute: FakeCompute):
        self.compute = compute

    def _policies(self) -> dict[str, dict[str, Any]]:
        return self.compute.storage.iam_policies

    def role_permissions(self, role: str) -> set[str]:
        custom = self.compute.storage.roles.get(role)
        if custom is not None:
            return set() if custom.get("deleted") else set(custom["includedPermissions"])
        return PREDEFINED.get(role, set())

    def granted(self, email: str, permission: str, name: str, type_: str,
                policies: list[dict[str, Any] | None]) -> bool:  # fmt: skip
        member = f"serviceAccount:{email}"
        for pol in policies:
            for b in (pol or {}).get("bindings") or []:
                if member not in (b.get("members") or []):
                    continue
                if permission not in self.role_permissions(str(b.get("role"))):
                    continue
                cond = b.get("condition")
                if not cond or condition_holds(str(cond.get("expression", "")), name, type_):
                    return True
        return False

    def need(self, email: str, project: str, permission: str, name: str, type_: str,
             own: dict[str, Any] | None = None) -> None:  # fmt: skip
        pols = [self._policies().get(f"projects/{project}"), own]
        if not self.granted(email, permission, name, type_, pols):
            raise Refused(403, "forbidden", f"Required '{permission}' permission for '{name}'")

    def check(self, email: str, key: str, args: dict[str, str], body: Any) -> None:
        """Raise Refused unless `email` may make this call."""
        p = args["project"]
        vm = "compute.googleapis.com/Instance"
        if key in ("instances.get", "instances.delete", "instances.getGuestAttributes"):
            verb = key.split(".", 1)[1]
            self.need(email, p, f"compute.instances.{verb}",
                      f"projects/{p}/zones/{args['zone']}/instances/{args['name']}", vm)
        elif key == "instances.insert":
            self._insert(email, p, args["zone"], body or {})
        elif key in ("images.get", "images.getFromFamily") and p != self.compute.project_of(
                email):  # fmt: skip
            return  # a public image: every authenticated user may read it
        elif key == "resourcePolicies.get":
            n = f"projects/{p}/regions/{args['region']}/resourcePolicies/{args['name']}"
            self.need(email, p, "compute.resourcePolicies.get", n,
                      "compute.googleapis.com/ResourcePolicy",
                      self.compute.policy_iam.get((args["region"], args["name"])))
        else:
            self.need(email, p, _verb_permission(key), f"projects/{p}", PROJECT_TYPE)

    def _insert(self, email: str, p: str, zone: str, body: dict[str, Any]) -> None:
        region = zone.rsplit("-", 1)[0]
        vm = f"projects/{p}/zones/{zone}/instances/{body.get('name', '')}"
        vm_type = "compute.googleapis.com/Instance"
        self.need(email, p, "compute.instances.create", vm, vm_type)
        for disk in body.get("disks") or []:
            params = disk.get("initializeParams") or {}
            if params:
                dname = params.get("diskName") or body.get("name", "")
                self.need(email, p, "compute.disks.create",
                          f"projects/{p}/zones/{zone}/disks/{dname}",
                          "compute.googleapis.com/Disk")
                img = re.fullmatch(r"(?:.*/)?projects/([^/]+)/global/images/.*",
                                   str(params.get("sourceImage", "")))
                if img and img.group(1) == p:
                    self.need(email, p, "compute.images.useReadOnly", params["sourceImage"],
                              "compute.googleapis.com/Image")
        for field, perm in (("metadata", "setMetadata"), ("labels", "setLabels"),
                            ("tags", "setTags"), ("serviceAccounts", "setServiceAccount")):
            value = body.get(field)
            if isinstance(value, dict) and field in ("metadata", "tags"):
                value = value.get("items")
            if value:
                self.need(email, p, f"compute.instances.{perm}", vm, vm_type)
        for i, nic in enumerate(body.get("networkInterfaces") or []):
            sregion, sname = self.compute.nic_subnetwork(region, nic, i)
            sub = f"projects/{p}/regions/{sregion}/subnetworks/{sname}"
            own = self.compute.subnet_iam.get((sregion, sname))
            sub_type = "compute.googleapis.com/Subnetwork"
            self.need(email, p, "compute.subnetworks.use", sub, sub_type, own)
            if nic.get("accessConfigs"):
                self.need(email, p, "compute.subnetworks.useExternalIp", sub, sub_type, own)
        for url in body.get("resourcePolicies") or []:
            m = re.fullmatch(r"(?:.*/)?projects/[^/]+/regions/([^/]+)/resourcePolicies/([^/]+)",
                             url)
            if m:
                self.need(email, p, "compute.resourcePolicies.use",
                          f"projects/{p}/regions/{m.group(1)}/resourcePolicies/{m.group(2)}",
                          "compute.googleapis.com/ResourcePolicy",
                          self.compute.policy_iam.get((m.group(1), m.group(2))))
        for sa in body.get("serviceAccounts") or []:
            target = str(sa.get("email", ""))
            own = self._policies().get(f"serviceAccounts/{target}")
            pols = [self._policies().get(f"projects/{p}"), own]
            if not self.granted(email, "iam.serviceAccounts.actAs",
                                f"projects/{p}/serviceAccounts/{target}",
                                "iam.googleapis.com/ServiceAccount", pols):  # fmt: skip
                raise Refused(400, "badRequest", f"The user does not have access to service "
                              f"account '{target}'. User: '{email}'. Ask a project owner to "
                              "grant you the iam.serviceAccountUser role on the service "
                              "account")  # fmt: skip
