"""GCP provider, checkpoint storage and node identity: a GCS prefix per cluster, reachable
from the workers through a service account scoped to it.

This module owns where a cluster's checkpoints live on GCP and who may touch them: the
bucket (gcp.bucket, else `spotctl-<project>-<region>`, created on first use with uniform
bucket-level access and public access prevention enforced), the cluster's prefix
`<cluster>/` in it (its `checkpoints` is the default train.checkpoint_dir on GCP), and the
service account `spotctl-<cluster>@<project>.iam.gserviceaccount.com` that the worker VMs
run as (cloud-platform scope; what it may do is decided by IAM, not by the scope).

The account's access is two bindings on the bucket's IAM policy (version 3):
- roles/storage.objectUser under the IAM condition
  `resource.name.startsWith("projects/_/buckets/<bucket>/objects/<cluster>/")`: read,
  write and delete objects under the cluster's prefix only;
- roles/storage.legacyBucketReader (storage.buckets.get, storage.objects.list), without
  a condition: GCS checks a listing against the bucket, never against a prefix, so no
  condition can scope it; gcsfs needs both to list and to find the bucket. Other
  clusters' object names in a shared bucket are visible to it, their contents are not.
`down` removes both bindings and the account and keeps the checkpoints; a purge
(ctx.options["purge"]) also deletes the objects under the prefix.

The calls are plain JSON REST (storage/v1, iam/v1) through google-auth's
AuthorizedSession (requests), which google-cloud-compute already brings: no client
library is added to the [gcp] extra. Errors go through GcpApi._call (429/5xx retried,
403 an AuthError naming templates/gcp-roles.txt). Under a test endpoint (gcp_endpoint /
SPOTCTL_GCP_ENDPOINT) storage and IAM are served from it too, anonymously.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any

from spotctl.errors import AuthError, ProviderError, SpecError
from spotctl.providers.base import ClusterCheckpoints
from spotctl.providers.gcp.api import GcpApi, _one_line, worker_prefix

CLOUD_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
STORAGE_URL = "https://storage.googleapis.com"
IAM_URL = "https://iam.googleapis.com"
RESOURCE_MANAGER_URL = "https://cloudresourcemanager.googleapis.com"
# The head ([rebalance] on_head). Its rights, each on the narrowest resource the API offers:
# - a custom role of the project (HEAD_ROLE_ID, HEAD_PERMISSIONS) bound on the project under
#   head_condition(): create, read and delete this cluster's worker VMs and their boot disks
#   by name; list VMs and wait on zone operations (IAM checks those on the project, where no
#   condition on a VM's name can reach: the list is the one project-wide read left);
# - roles/compute.networkUser on the cluster's subnetwork alone (its own IAM policy,
#   subnetworks.setIamPolicy), not on the project;
# - roles/iam.serviceAccountUser on the workers' account alone (ACT_AS_ROLE);
# - the use of the cluster's compact placement policies, on each policy (launch.py).
# No compute.instances.setTags: GCE needs it to create a VM with network tags, so the head
# cannot put a tag on a VM (tags open other teams' tag-based firewall rules); the cluster's
# firewall rules pick its VMs by service account instead (network.py).
HEAD_ROLE_ID = "spotctlHead"
HEAD_PERMISSIONS = (
    "compute.instances.create",
    "compute.instances.delete",
    "compute.instances.get",
    "compute.instances.getGuestAttributes",
    "compute.instances.list",
    "compute.instances.setLabels",
    "compute.instances.setMetadata",
    "compute.instances.setServiceAccount",
    "compute.disks.create",
    "compute.resourcePolicies.get",
    "compute.zoneOperations.get",
)
HEAD_NET_ROLE = "roles/compute.networkUser"  # on the cluster's subnetwork only
OS_LOGIN_CONSTRAINT = "constraints/compute.requireOsLogin"
ACT_AS_ROLE = "roles/iam.serviceAccountUser"  # on the workers' account only
OBJECT_ROLE = "roles/storage.objectUser"
LIST_ROLE = "roles/storage.legacyBucketReader"
SA_DOMAIN = ".iam.gserviceaccount.com"


class RestError(Exception):
    """An HTTP error from the storage or IAM JSON API, in the shape `classify` reads."""

    def __init__(self, code: int, text: str):
        self.code = code
        self.errors: list[dict[str, Any]] = []
        self.reason = ""
        message = _one_line(text)[:300]
        try:
            err = json.loads(text).get("error", {})
            message = str(err.get("message") or message)
            # reasons only: the message `classify` shows is ours, with the status code
            self.errors = [
                {"reason": e["reason"]}
                for e in err.get("errors") or []
                if isinstance(e, dict) and e.get("reason")
            ]
            self.reason = str(err.get("status") or "")
        except (ValueError, AttributeError):
            pass
        self.message = f"{code} {message}"
        super().__init__(self.message)


def bucket_name_for(project: str, region: str) -> str:
    """The default bucket: `spotctl-<project>-<region>`, as GCS bucket names allow it
    (lowercase letters, digits, '-'; at most 63 characters)."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"spotctl-{project}-{region}".lower()).strip("-")
    if len(name) > 63:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = name[:54].rstrip("-") + "-" + digest
    return name


def account_id_for(cluster: str) -> str:
    """The cluster's service account id: 6-30 characters of [a-z0-9-], starting with a
    letter (`spotctl-<cluster>`, shortened with a digest when the cluster name is long)."""
    base = re.sub(r"[^a-z0-9-]+", "-", cluster.lower()).strip("-")
    acc = f"spotctl-{base}".rstrip("-")
    if len(acc) > 30:
        digest = hashlib.sha256(cluster.encode()).hexdigest()[:6]
        acc = acc[:23].rstrip("-") + "-" + digest
    return acc


def head_account_id_for(cluster: str) -> str:
    """The head's service account id ([rebalance] on_head): `spotctlh-<cluster>`, which no
    cluster's workers' id (`spotctl-...`) can equal."""
    return "spotctlh-" + account_id_for(cluster).removeprefix("spotctl-")[:21].rstrip("-")


def check_bucket_name(name: str) -> str | None:
    """Why GCS would refuse `name` as a bucket name, or None."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]", name):
        return "3-63 characters of lowercase letters, digits, '-', '_' and '.'"
    if name.startswith("goog") or "google" in name:
        return "names starting with 'goog' or containing 'google' are reserved"
    return None


class GcpStorage(ClusterCheckpoints, GcpApi):
    """Bucket, prefix and the workers' service account."""

    _http_session: Any = None

    # ----------------------------------------------------------------- REST

    def _http(self) -> Any:
        if self._http_session is None:
            from google.auth.transport.requests import AuthorizedSession

            if self.endpoint:
                from google.auth.credentials import AnonymousCredentials

                creds: Any = AnonymousCredentials()
            else:
                import google.auth

                from spotctl.errors import AuthError

                try:
                    creds, _ = google.auth.default(scopes=[CLOUD_SCOPE])
                except Exception as e:  # noqa: BLE001 - any failure means no credentials
                    raise AuthError(
                        "gcp: no credentials found (run `gcloud auth application-default "
                        f"login` or set GOOGLE_APPLICATION_CREDENTIALS): {_one_line(str(e))}"
                    ) from None
            self._http_session = AuthorizedSession(creds)
        return self._http_session

    def _rest(
        self,
        what: str,
        method: str,
        url: str,
        *,
        params: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
        missing_ok: bool = False,
    ) -> dict[str, Any] | None:
        """One JSON call through `_call` (retries, error mapping); None on 404 when
        `missing_ok`."""

        def run() -> dict[str, Any]:
            r = self._http().request(method, url, params=params, json=body, timeout=60)
            if r.status_code >= 400:
                raise RestError(r.status_code, r.text)
            return r.json() if r.content else {}

        return self._call(what, run, missing_ok=missing_ok)

    @property
    def _storage_base(self) -> str:
        return f"{self.endpoint or STORAGE_URL}/storage/v1"

    @property
    def _iam_base(self) -> str:
        return f"{self.endpoint or IAM_URL}/v1/projects/{self.project}/serviceAccounts"

    # ----------------------------------------------------------------- names

    def bucket_name(self) -> str:
        return self.spec.bucket or bucket_name_for(self.project, self.region)

    @property
    def prefix(self) -> str:
        return f"{self.ctx.cluster}/"

    def checkpoint_uri(self) -> str:
        return f"gs://{self.bucket_name()}/{self.prefix}checkpoints"

    @property
    def node_account(self) -> str:
        """The workers' service account email."""
        return f"{account_id_for(self.ctx.cluster)}@{self.project}{SA_DOMAIN}"

    @property
    def head_account(self) -> str:
        """The head's service account email ([rebalance] on_head)."""
        return f"{head_account_id_for(self.ctx.cluster)}@{self.project}{SA_DOMAIN}"

    @property
    def head_role(self) -> str:
        """The project's custom role the head's account holds (one per project, the same
        permissions for every cluster: each cluster's binding carries its own condition)."""
        return f"projects/{self.project}/roles/{HEAD_ROLE_ID}"

    def head_condition(self) -> dict[str, str]:
        """Where the head's role applies: this cluster's worker VMs and their boot disks,
        by name (`<cluster>--`, which no other cluster's names and not its head's start
        with) in the zones of its region, and what is neither a VM nor a disk: the project and its zones, which is
        where IAM checks compute.instances.list and compute.zoneOperations.get, and the
        resource policies it reads (IAM, "Configure resource-based access": a role with
        list permissions needs such a term, the name of a list's resource is its parent's).
        The role holds nothing else for those to grant. Only the functions IAM documents
        for resource names (startsWith, endsWith, extract): it refuses any other."""
        prefix = worker_prefix(self.ctx.cluster)
        vm, disk = "compute.googleapis.com/Instance", "compute.googleapis.com/Disk"
        zones = f"projects/{self.project}/zones/{self.region}-"  # the region's zones
        return {
            "title": f"spotctl-{self.ctx.cluster}-head"[:100],
            "description": f"spotctl cluster {self.ctx.cluster}: its own workers only",
            "expression": (
                f'(resource.type == "{vm}" && resource.name.startsWith("{zones}") && '
                f'resource.name.extract("/instances/{{name}}").startsWith("{prefix}")) || '
                f'(resource.type == "{disk}" && resource.name.startsWith("{zones}") && '
                f'resource.name.extract("/disks/{{name}}").startsWith("{prefix}")) || '
                f'(resource.type != "{vm}" && resource.type != "{disk}")'
            ),
        }

    def head_bindings(self) -> list[dict[str, Any]]:
        """The head's project-level binding: its custom role, under head_condition()."""
        member = f"serviceAccount:{self.head_account}"
        return [{"role": self.head_role, "members": [member], "condition": self.head_condition()}]

    def head_role_resource(self) -> dict[str, Any]:
        """The custom role as IAM's roles.create takes it."""
        return {"title": "spotctl head",
                "description": "spotctl: what a cluster's head needs to replace its workers "
                               "(bound per cluster under a condition on their names)",
                "includedPermissions": sorted(HEAD_PERMISSIONS), "stage": "GA"}  # fmt: skip

    def _after_policy_conflict(self, e: ProviderError, attempt: int, add: bool) -> None:
        """A setIamPolicy failed: raise `e` unless another read-modify-write may pass (a
        concurrent change, 409/412, or a member IAM does not know yet), else wait first."""
        retry = "409" in str(e) or "412" in str(e) or (add and "does not exist" in str(e))
        if not retry or attempt == 5:
            raise e
        time.sleep(min(5.0, self.retry.base_s * 2**attempt))

    def _edit_policy(self, what: str, url: str, member: str,
                     add: list[dict[str, Any]]) -> None:
        """Read-modify-write an IAM policy (projects / service accounts: POST
        :getIamPolicy / :setIamPolicy, version 3, etag-checked, a concurrent change
        retried): every binding of `member` dropped, then `add` put in."""
        for attempt in range(6):
            policy = self._rest(f"read the IAM policy of {what}", "POST", f"{url}:getIamPolicy",
                                body={"options": {"requestedPolicyVersion": 3}}) or {}
            old = policy.get("bindings") or []
            bindings = []
            for b in old:
                members = [m for m in b.get("members") or [] if m != member]
                if members:
                    bindings.append({**b, "members": members})
            if not add and len(bindings) == len(old) and all(
                    member not in (b.get("members") or []) for b in old):
                return  # nothing of ours there
            new = {"bindings": bindings + add, "etag": policy.get("etag", ""), "version": 3}
            try:
                self._rest(f"set the IAM policy of {what}", "POST", f"{url}:setIamPolicy",
                           body={"policy": new})
                return
            except ProviderError as e:
                self._after_policy_conflict(e, attempt, bool(add))

    @property
    def _project_url(self) -> str:
        return f"{self.endpoint or RESOURCE_MANAGER_URL}/v1/projects/{self.project}"

    def os_login_enforced(self) -> bool | None:
        """Whether the project's organization enforces OS Login on every VM
        (constraints/compute.requireOsLogin); None when its policy cannot be read (that
        needs orgpolicy.policy.get, which many identities lack)."""
        try:
            pol = self._rest("read the organization's OS Login policy", "POST",
                             f"{self._project_url}:getEffectiveOrgPolicy",
                             body={"constraint": OS_LOGIN_CONSTRAINT}) or {}
        except ProviderError:
            return None
        return bool((pol.get("booleanPolicy") or {}).get("enforced"))

    def refuse_os_login(self) -> bool | None:
        """One line when OS Login is enforced: spotctl logs in to its VMs with a key of
        its own in their metadata, which OS Login ignores (every bootstrap would fail).
        Else what os_login_enforced() said."""
        enforced = self.os_login_enforced()
        if enforced:
            raise SpecError(
                f"gcp: project {self.project}'s organization enforces OS Login "
                f"({OS_LOGIN_CONSTRAINT}), which ignores the SSH key spotctl puts in its "
                "VMs' metadata: ask for an exception to it for this project, or use another")
        return enforced

    def _ensure_head_identity(self) -> None:
        """The head's service account; where it replaces lost workers, its rights too:
        the project's custom role under the cluster's condition, networkUser on the
        cluster's subnetwork, and the use of the workers' account (module docstring)."""
        email = self.head_account
        self._ensure_account(email, head_account_id_for(self.ctx.cluster),
                             f"spotctl {self.ctx.cluster} head",
                             f"spotctl cluster {self.ctx.cluster}: the head replaces its "
                             "lost workers")  # fmt: skip
        if not self.ctx.spec.head_rebalances:
            return  # an account with no role and no scopes: what the firewall picks it by
        member = f"serviceAccount:{email}"
        try:
            self._ensure_head_role()
            self._edit_policy(f"project {self.project}", self._project_url, member,
                              self.head_bindings())
        except AuthError as e:
            raise AuthError(
                f"{e} (the head replaces lost nodes itself only where spotctl may create a "
                "custom role and set the project's IAM policy, iam.roles.create and "
                "resourcemanager.projects.setIamPolicy: grant them, or set [rebalance] "
                "on_head = false and run `spotctl rebalance` from cron)"
            ) from None
        self._edit_subnet_policy(member, add=True)
        self._edit_policy(f"service account {self.node_account}",
                          f"{self._iam_base}/{self.node_account}", member,
                          [{"role": ACT_AS_ROLE, "members": [member]}])

    @property
    def _roles_base(self) -> str:
        return f"{self.endpoint or IAM_URL}/v1/projects/{self.project}/roles"

    def _ensure_head_role(self) -> None:
        """The project's custom role for heads (IAM roles.create), brought back if it was
        deleted and set to HEAD_PERMISSIONS if it drifted. `down` leaves it: other
        clusters' heads may hold it, and a role no binding names grants nothing."""
        url, want = f"{self._roles_base}/{HEAD_ROLE_ID}", self.head_role_resource()
        have = self._rest(f"look up custom role {HEAD_ROLE_ID}", "GET", url, missing_ok=True)
        if have is None:
            try:
                self._rest(f"create custom role {HEAD_ROLE_ID}", "POST", self._roles_base,
                           body={"roleId": HEAD_ROLE_ID, "role": want})
                return
            except ProviderError as e:
                if "409" not in str(e):
                    raise
                have = self._rest(f"look up custom role {HEAD_ROLE_ID}", "GET", url) or {}
        if have.get("deleted"):
            self._rest(f"undelete custom role {HEAD_ROLE_ID}", "POST", f"{url}:undelete",
                       body={"etag": have.get("etag", "")})
        if sorted(have.get("includedPermissions") or []) != want["includedPermissions"]:
            self._rest(f"update custom role {HEAD_ROLE_ID}", "PATCH", url,
                       params={"updateMask": "includedPermissions,title,description,stage"},
                       body=want)

    def _edit_subnet_policy(self, member: str, add: bool) -> None:
        """`member` holds networkUser on the cluster's subnetwork (add) or nothing there:
        the subnetwork's own IAM policy (Compute subnetworks.getIamPolicy /
        setIamPolicy), etag-checked, a concurrent change retried."""
        from functools import partial

        from google.cloud import compute_v1

        from spotctl.providers.gcp.api import subnetwork_name

        name = subnetwork_name(self.region).rsplit("/", 1)[-1]
        what = f"the IAM policy of subnetwork {name} in {self.region}"
        for attempt in range(6):
            req_get = compute_v1.GetIamPolicySubnetworkRequest(
                project=self.project, region=self.region, resource=name,
                options_requested_policy_version=3)
            pol = self._call(f"read {what}", partial(
                self.clients.subnetworks.get_iam_policy, request=req_get, retry=None))
            assert pol is not None
            kept = []
            for b in pol.bindings:
                members = [m for m in b.members if m != member]
                if members:
                    kw = {"condition": b.condition} if "condition" in b else {}
                    kept.append(compute_v1.Binding(role=b.role, members=members, **kw))
            if not add and len(kept) == len(pol.bindings) and all(
                    member not in b.members for b in pol.bindings):
                return
            if add:
                kept.append(compute_v1.Binding(role=HEAD_NET_ROLE, members=[member]))
            new = compute_v1.Policy(bindings=kept, etag=pol.etag, version=3)
            req = compute_v1.RegionSetPolicyRequest(policy=new)
            try:
                self._call(f"set {what}", partial(
                    self.clients.subnetworks.set_iam_policy, project=self.project,
                    region=self.region, resource=name,
                    region_set_policy_request_resource=req, retry=None))  # fmt: skip
                return
            except ProviderError as e:
                self._after_policy_conflict(e, attempt, bool(add))

    def _delete_head_identity(self) -> list[str]:
        """The head's bindings (project, subnetwork; the workers' account goes with its
        own policy), then its account. Nothing to do (and no policy read, which an
        identity without on_head may not do) when the account is not there, and no
        binding to remove where the head replaces nothing: its bindings go first, so a
        down cut short leaves the account."""
        email, leaks = self.head_account, []
        try:
            if self._rest(f"look up service account {email}", "GET",
                          f"{self._iam_base}/{email}", missing_ok=True) is None:
                return []
        except ProviderError as e:
            return [f"service account {email}: {e}"]
        member = f"serviceAccount:{email}"
        if self.ctx.spec.head_rebalances:
            try:
                self._edit_policy(f"project {self.project}", self._project_url, member, [])
            except ProviderError as e:
                leaks.append(f"project IAM bindings of {email}: {e}")
            try:
                self._edit_subnet_policy(member, add=False)
            except ProviderError as e:
                leaks.append(f"subnetwork IAM binding of {email}: {e}")
        try:
            self._rest(f"delete service account {email}", "DELETE",
                       f"{self._iam_base}/{email}", missing_ok=True)
        except ProviderError as e:
            leaks.append(f"service account {email}: {e}")
        return leaks

    def _ensure_account(self, email: str, account_id: str, display: str,
                        description: str) -> None:
        found = self._rest(
            f"look up service account {email}", "GET", f"{self._iam_base}/{email}", missing_ok=True
        )
        if found is None:
            try:
                self._rest(
                    f"create service account {email}", "POST", self._iam_base,
                    body={"accountId": account_id,
                          "serviceAccount": {"displayName": display[:100],
                                             "description": description}},
                )  # fmt: skip
            except ProviderError as e:
                if "409" not in str(e):
                    raise

    def _condition(self) -> dict[str, str]:
        return {
            "title": f"spotctl-{self.ctx.cluster}"[:100],
            "description": f"spotctl cluster {self.ctx.cluster}: its checkpoint prefix only",
            "expression": 'resource.name.startsWith("projects/_/buckets/'
            f'{self.bucket_name()}/objects/{self.prefix}")',
        }

    # ----------------------------------------------------------------- bucket

    def _get_bucket(self) -> dict[str, Any] | None:
        """The bucket's resource; None when there is no bucket of that name. A bucket this
        identity cannot read (another project's) is a SpecError naming gcp.bucket."""
        bucket = self.bucket_name()
        try:
            return self._rest(
                f"look up bucket {bucket}",
                "GET",
                f"{self._storage_base}/b/{bucket}",
                missing_ok=True,
            )
        except ProviderError as e:
            if "permission denied" not in str(e):
                raise
            raise SpecError(
                f"gcp.bucket: bucket {bucket} exists but this identity cannot read it "
                "(another project's name, or storage.buckets.get missing); set gcp.bucket "
                "to a bucket of this project"
            ) from None

    def bucket_exists(self) -> bool:
        return self._get_bucket() is not None

    def _ensure_bucket(self) -> None:
        bucket = self.bucket_name()
        why = check_bucket_name(bucket)
        if why:
            raise SpecError(f"gcp.bucket: {bucket!r} is not a valid bucket name ({why})")
        found = self._get_bucket()
        if found is None:
            if self.spec.bucket:
                raise SpecError(f"gcp.bucket: bucket {bucket} does not exist (or is not yours)")
            body = {
                "name": bucket,
                "location": self.region.upper(),
                "iamConfiguration": {
                    "uniformBucketLevelAccess": {"enabled": True},
                    "publicAccessPrevention": "enforced",
                },
                "labels": {"spotctl": "checkpoints"},
            }
            try:
                found = self._rest(
                    f"create bucket {bucket}",
                    "POST",
                    f"{self._storage_base}/b",
                    params={"project": self.project},
                    body=body,
                )
            except ProviderError as e:
                if "409" not in str(e):
                    raise
                # Created meanwhile by another controller of this project, or the name is
                # someone else's: the lookup tells which.
                found = self._get_bucket()
                if found is None:
                    raise SpecError(
                        f"gcp.bucket: the bucket name {bucket} is taken; set gcp.bucket"
                    ) from None
        ubla = ((found or {}).get("iamConfiguration") or {}).get("uniformBucketLevelAccess")
        if not (ubla or {}).get("enabled"):
            raise SpecError(
                f"gcp.bucket: bucket {bucket} has no uniform bucket-level access; spotctl "
                "scopes the workers' service account with an IAM condition, which needs it "
                f"(gcloud storage buckets update gs://{bucket} --uniform-bucket-level-access)"
            )

    def purge_checkpoints(self) -> int:
        """Delete every object under the cluster's prefix; how many were deleted."""
        if not self.bucket_exists():
            return 0
        bucket, n = self.bucket_name(), 0
        token = ""
        while True:
            params = {"prefix": self.prefix, "fields": "items(name),nextPageToken"}
            if token:
                params["pageToken"] = token
            page = (
                self._rest(
                    f"list gs://{bucket}/{self.prefix}",
                    "GET",
                    f"{self._storage_base}/b/{bucket}/o",
                    params=params,
                )
                or {}
            )
            for item in page.get("items", []):
                from urllib.parse import quote

                self._rest(
                    f"delete gs://{bucket}/{item['name']}",
                    "DELETE",
                    f"{self._storage_base}/b/{bucket}/o/{quote(item['name'], safe='')}",
                    missing_ok=True,
                )
                n += 1
            token = str(page.get("nextPageToken") or "")
            if not token:
                return n

    # ----------------------------------------------------------------- node identity

    def _edit_bucket_policy(self, member: str, add: bool) -> None:
        """Read-modify-write the bucket's IAM policy (version 3, etag-checked; a
        concurrent change is retried): drop every binding of `member`, then add the
        workers' two bindings when `add`."""
        bucket = self.bucket_name()
        url = f"{self._storage_base}/b/{bucket}/iam"
        for attempt in range(6):
            policy = (
                self._rest(
                    f"read IAM policy of bucket {bucket}",
                    "GET",
                    url,
                    params={"optionsRequestedPolicyVersion": 3},
                )
                or {}
            )
            bindings = []
            for b in policy.get("bindings") or []:
                members = [m for m in b.get("members") or [] if m != member]
                if members:
                    bindings.append({**b, "members": members})
            if add:
                bindings.append(
                    {"role": OBJECT_ROLE, "members": [member], "condition": self._condition()}
                )
                bindings.append({"role": LIST_ROLE, "members": [member]})
            elif len(bindings) == len(policy.get("bindings") or []) and all(
                member not in (b.get("members") or []) for b in policy.get("bindings") or []
            ):
                return  # nothing of ours there
            new = {"bindings": bindings, "etag": policy.get("etag", ""), "version": 3}
            try:
                self._rest(f"set IAM policy of bucket {bucket}", "PUT", url, body=new)
                return
            except ProviderError as e:
                # 412: someone changed the policy since we read it. 400 "does not exist":
                # a just-created service account is not visible to IAM yet.
                retry = "412" in str(e) or (add and "does not exist" in str(e))
                if not retry or attempt == 5:
                    raise
                time.sleep(min(5.0, self.retry.base_s * 2**attempt))

    def prepare_storage(self) -> None:
        """The bucket and the workers' account (ClusterCheckpoints); on the head itself,
        nothing: the controller made them, and the spec the head was given names the
        checkpoint prefix."""
        if self._on_head:
            return
        super().prepare_storage()

    def _ensure_node_identity(self) -> None:
        email = self.node_account
        self._ensure_account(email, account_id_for(self.ctx.cluster),
                             f"spotctl {self.ctx.cluster} workers",
                             f"spotctl cluster {self.ctx.cluster}: the workers' checkpoints "
                             f"under gs://{self.bucket_name()}/{self.prefix}")  # fmt: skip
        # Set every time: reconciled if the bucket or the condition changed.
        self._edit_bucket_policy(f"serviceAccount:{email}", add=True)

    def _delete_node_identity(self) -> list[str]:
        """Remove the workers' account (its bucket bindings first) and the head's (its
        project bindings first); leaks as lines."""
        return self._delete_workers_identity() + self._delete_head_identity()

    def _delete_workers_identity(self) -> list[str]:
        email, leaks = self.node_account, []
        try:
            if self.bucket_exists():
                self._edit_bucket_policy(f"serviceAccount:{email}", add=False)
        except (ProviderError, SpecError) as e:
            leaks.append(f"bucket IAM binding of {email}: {e}")
        try:
            self._rest(
                f"delete service account {email}",
                "DELETE",
                f"{self._iam_base}/{email}",
                missing_ok=True,
            )
        except ProviderError as e:
            leaks.append(f"service account {email}: {e}")
        self._storage_ready = False
        return leaks

    def _service_accounts(self, role: str) -> list[Any]:
        """The serviceAccounts of a VM's insert: workers run as the cluster's account
        (made by prepare_storage, which `launch` runs first); the head as its own."""
        from google.cloud import compute_v1

        if role != "worker":
            # the head runs as its own account (the cluster's firewall rules pick it by
            # that); with no scope where it replaces nothing, so its VM has no API token
            scopes = [CLOUD_SCOPE] if self.ctx.spec.head_rebalances else []
            return [compute_v1.ServiceAccount(email=self.head_account, scopes=scopes)]
        return [compute_v1.ServiceAccount(email=self.node_account, scopes=[CLOUD_SCOPE])]
