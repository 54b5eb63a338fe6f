"""The Cloud Storage JSON API and IAM service accounts, served by the fake GCP server.

FakeCompute (fake_compute.py) answers these paths on its one endpoint, as GCP would on
storage.googleapis.com and iam.googleapis.com: spotctl's provider (plain REST) and the
real gcsfs (STORAGE_EMULATOR_HOST / endpoint_url) both talk to it.

Storage: buckets insert / get / delete, getIamPolicy / setIamPolicy; objects insert
(uploadType media, multipart and resumable, with the 308 + Range answers gcsfs drives its
chunks by), get (metadata, or alt=media with Range, also under /download), move, rewrite (copy), list (prefix,
delimiter, maxResults/pageToken) and delete. IAM: service accounts create / get / delete.

Refused as GCP refuses: bucket names outside 3-63 characters of [a-z0-9._-] (starting and
ending with a letter or digit), starting with "goog" or containing "google"; a name that
is taken (409; `foreign_buckets` are other projects' buckets: get answers 403); unknown
buckets and objects (404); service account ids that are not 6-30 characters of [a-z0-9-]
starting with a letter (400), a taken id (409); a bucket policy naming a service account
that does not exist (400), one with a condition but a version below 3 or on a bucket
without uniform bucket-level access (400), or a stale etag (412); a resumable chunk that
does not start where the upload stands (400). Error bodies: storage
{"error": {"code", "message", "errors": [{"reason", ...}]}}, IAM {"error": {"code",
"message", "status"}}.

Who calls: a request with `Authorization: Bearer <token>` acts as the service account the
token was issued to (`issue_token`, or an `InstanceMetadata` server's token endpoint, the
GCE metadata protocol a VM's google-auth uses); an unknown or revoked token, or one whose
account was deleted, is a 401. Such a request is checked against the bucket's IAM policy,
as GCS checks it: each binding's role grants its permissions (ROLE_PERMISSIONS) to its
members where its condition holds; the condition sees `resource.name` and
`resource.type` of what the call touches: the object (`projects/_/buckets/B/objects/N`)
for get, insert, delete, copy and move, the bucket (`projects/_/buckets/B`) for a listing
and the bucket's own calls. So a prefix condition never grants a listing. Writing over an
existing object needs storage.objects.delete too. Project-level calls (bucket create,
service accounts) are refused to a service account: none is granted a project role here.
A refused call is a 403 naming the account and the permission. Anonymous requests act as
the project's owner: spotctl's own calls against a test endpoint are anonymous.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

if TYPE_CHECKING:
    from .fake_compute import FakeCompute

_B = r"/storage/v1/b/(?P<bucket>[^/]+)"
_SA = r"/v1/projects/(?P<project>[^/]+)/serviceAccounts"
STORAGE_ROUTES: list[tuple[str, str, re.Pattern[str]]] = [
    (m, key, re.compile(rx + "$"))
    for m, key, rx in [
        ("POST", "storage.buckets.insert", r"/storage/v1/b"),
        ("GET", "storage.buckets.get", _B),
        ("DELETE", "storage.buckets.delete", _B),
        ("GET", "storage.buckets.getIamPolicy", _B + r"/iam"),
        ("PUT", "storage.buckets.setIamPolicy", _B + r"/iam"),
        ("GET", "storage.objects.list", _B + r"/o"),
        ("GET", "storage.objects.get", r"(?:/download)?" + _B + r"/o/(?P<obj>.+)"),
        ("DELETE", "storage.objects.delete", _B + r"/o/(?P<obj>.+)"),
        ("POST", "storage.objects.move", _B + r"/o/(?P<obj>[^/]+)/moveTo/o/(?P<dst>[^/]+)"),
        (
            "POST",
            "storage.objects.rewrite",
            _B + r"/o/(?P<obj>[^/]+)/rewriteTo/b/(?P<dbucket>[^/]+)/o/(?P<dst>[^/]+)",
        ),
        ("POST", "storage.objects.compose", _B + r"/o/(?P<dst>[^/]+)/compose"),
        ("POST", "storage.objects.insert", r"/upload" + _B + r"/o"),
        ("PUT", "storage.objects.insert", r"/upload" + _B + r"/o"),
        ("POST", "iam.serviceAccounts.create", _SA),
        ("GET", "iam.serviceAccounts.get", _SA + r"/(?P<email>[^/]+)"),
        ("DELETE", "iam.serviceAccounts.delete", _SA + r"/(?P<email>[^/]+)"),
        # a service account's own policy (who may act as it), and the project's
        ("POST", "iam.serviceAccounts.getIamPolicy", _SA + r"/(?P<email>[^/:]+):getIamPolicy"),
        ("POST", "iam.serviceAccounts.setIamPolicy", _SA + r"/(?P<email>[^/:]+):setIamPolicy"),
        ("POST", "cloudresourcemanager.projects.getIamPolicy",
         r"/v1/projects/(?P<project>[^/:]+):getIamPolicy"),
        ("POST", "cloudresourcemanager.projects.setIamPolicy",
         r"/v1/projects/(?P<project>[^/:]+):setIamPolicy"),
        # the project's custom roles (IAM roles API)
        ("POST", "iam.roles.create", r"/v1/projects/(?P<project>[^/:]+)/roles"),
        ("GET", "iam.roles.get", r"/v1/projects/(?P<project>[^/:]+)/roles/(?P<role>[^/:]+)"),
        ("PATCH", "iam.roles.update",
         r"/v1/projects/(?P<project>[^/:]+)/roles/(?P<role>[^/:]+)"),
        ("DELETE", "iam.roles.delete",
         r"/v1/projects/(?P<project>[^/:]+)/roles/(?P<role>[^/:]+)"),
        ("POST", "iam.roles.undelete",
         r"/v1/projects/(?P<project>[^/:]+)/roles/(?P<role>[^/:]+):undelete"),
        # the organization's policies as they reach the project (one constraint a call)
        ("POST", "cloudresourcemanager.projects.getEffectiveOrgPolicy",
         r"/v1/projects/(?P<project>[^/:]+):getEffectiveOrgPolicy"),
    ]
]
MAX_COMPONENTS = 1024  # GCS: components of one composite object
BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
ACCOUNT_ID_RE = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")
SA_DOMAIN = ".iam.gserviceaccount.com"
_OBJ_RW = {"storage.objects.create", "storage.objects.delete", "storage.objects.get",
           "storage.objects.list", "storage.objects.update"}  # fmt: skip
ROLE_PERMISSIONS: dict[str, set[str]] = {
    "roles/storage.objectViewer": {"storage.objects.get", "storage.objects.list"},
    "roles/storage.objectCreator": {"storage.objects.create"},
    "roles/storage.objectUser": _OBJ_RW,
    "roles/storage.objectAdmin": _OBJ_RW | {"storage.objects.getIamPolicy",
                                            "storage.objects.setIamPolicy"},
    "roles/storage.legacyBucketReader": {"storage.buckets.get", "storage.objects.list"},
    "roles/storage.legacyBucketWriter": {"storage.buckets.get", "storage.objects.list",
                                         "storage.objects.create", "storage.objects.delete"},
    "roles/storage.legacyBucketOwner": {"storage.buckets.get", "storage.buckets.update",
                                        "storage.buckets.getIamPolicy",
                                        "storage.buckets.setIamPolicy", "storage.objects.list",
                                        "storage.objects.create", "storage.objects.delete"},
    "roles/storage.admin": _OBJ_RW | {"storage.buckets.get", "storage.buckets.delete",
                                      "storage.buckets.update", "storage.buckets.getIamPolicy",
                                      "storage.buckets.setIamPolicy"},
}  # fmt: skip
# what a route needs on a bucket, beyond what its handler checks per object
_BUCKET_PERMISSION = {
    "storage.buckets.get": "storage.buckets.get",
    "storage.buckets.delete": "storage.buckets.delete",
    "storage.buckets.getIamPolicy": "storage.buckets.getIamPolicy",
    "storage.buckets.setIamPolicy": "storage.buckets.setIamPolicy",
    "storage.objects.list": "storage.objects.list",
}
_TERM_RE = re.compile(r'resource\.(name\.startsWith\(|type\s*==\s*)"([^"]*)"\)?')
_OBJECT_TYPE = "storage.googleapis.com/Object"
_BUCKET_TYPE = "storage.googleapis.com/Bucket"


# the functions IAM Conditions document (attribute reference: resource names take
# startsWith, endsWith and extract; dates and times; tags). CEL's own `matches`,
# `contains`, `size` are not among them: IAM refuses a policy that calls one
# ("undeclared reference to 'matches'").
CONDITION_FUNCTIONS = frozenset({
    "startsWith", "endsWith", "extract", "timestamp", "duration", "getFullYear", "getMonth",
    "getDate", "getDayOfMonth", "getDayOfWeek", "getDayOfYear", "getHours", "getMinutes",
    "getSeconds", "getMilliseconds", "hasTagKey", "hasTagKeyId", "matchTag", "matchTagId",
})  # fmt: skip
_CALL_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def undeclared_function(expression: str) -> str | None:
    """The first function an IAM condition calls that IAM does not offer, or None."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expression)
    for m in _CALL_RE.finditer(text):
        if m.group(1) not in CONDITION_FUNCTIONS:
            return m.group(1)
    return None


def condition_holds(expression: str, name: str, type_: str) -> bool:
    """An IAM condition of `resource.name.startsWith("...")` and `resource.type == "..."`
    terms joined by `||`, as GCS evaluates it for the resource `name` of `type_`. Anything
    else is refused loudly: a fake that guessed would grant what GCS might not."""
    holds = False
    for term in expression.split("||"):
        m = _TERM_RE.fullmatch(term.strip())
        if m is None:
            raise StorageError(500, "backendError", f"the fake cannot evaluate the IAM "
                               f"condition term {term.strip()!r}")  # fmt: skip
        if m.group(1).startswith("name"):
            holds = holds or name.startswith(m.group(2))
        else:
            holds = holds or type_ == m.group(2)
    return holds


class StorageError(Exception):
    def __init__(self, status: int, reason: str, message: str, iam: bool = False):
        super().__init__(message)
        self.status, self.reason, self.message, self.iam = status, reason, message, iam

    def body(self) -> dict[str, Any]:
        if self.iam:
            return {"error": {"code": self.status, "message": self.message,
                              "status": self.reason}}  # fmt: skip
        return {"error": {"code": self.status, "message": self.message,
                          "errors": [{"message": self.message, "domain": "global",
                                      "reason": self.reason}]}}  # fmt: skip


@dataclass
class _Upload:
    bucket: str
    name: str
    content_type: str
    data: bytearray = field(default_factory=bytearray)


Reply = tuple[int, dict[str, str], bytes]


class FakeStorage:
    def __init__(self, compute: FakeCompute):
        self.compute = compute
        self.buckets: dict[str, dict[str, Any]] = {}
        self.objects: dict[str, dict[str, tuple[bytes, dict[str, Any]]]] = {}
        self.policies: dict[str, dict[str, Any]] = {}
        self.foreign_buckets: set[str] = set()  # names other projects own
        self.service_accounts: dict[str, dict[str, Any]] = {}  # email -> resource
        # IAM policies of projects and of service accounts (resource name -> policy)
        self.iam_policies: dict[str, dict[str, Any]] = {}
        # the projects' custom roles: "projects/P/roles/ID" -> the role (a deleted one
        # stays, `deleted` true, until undeleted: IAM keeps it 7 days, its id longer)
        self.roles: dict[str, dict[str, Any]] = {}
        # boolean organization constraints enforced on the project (its organization's),
        # and whether the caller may read them (orgpolicy.policy.get)
        self.org_enforced: set[str] = set()
        self.org_policy_readable = True
        # False: the caller lacks resourcemanager.projects.setIamPolicy (no Project IAM
        # Admin), as many users' identities do
        self.project_iam_admin = True
        self._uploads: dict[str, _Upload] = {}
        self._gen = itertools.count(1_700_000_000_000_000)
        self.tokens: dict[str, str] = {}  # bearer token -> service account email
        self._caller: str | None = None  # the request's account; None: the project owner
        self.callers: list[tuple[str, str | None]] = []  # (route key, account) per request
        # upload requests (/upload/...) in flight at once, at most; each waits this long
        # (only those whose path or first 8 KiB hold `slow_uploads`, when it is set; or,
        # a callable, those it answers true for given those bytes)
        self.uploads_now = 0
        self.max_parallel_uploads = 0
        self.upload_latency_s = 0.0
        self.slow_uploads: bytes | Callable[[bytes], bool] = b""
        # object names holding one of these are refused (403) when uploaded (a failing
        # part) or, in refuse_deletes, when deleted
        self.refuse_names: set[str] = set()
        self.refuse_deletes: set[str] = set()

    def issue_token(self, email: str) -> str:
        """An access token for the service account `email`, as the metadata server of a VM
        running as it hands out."""
        with self.compute._lock:
            if email not in self.service_accounts:
                raise KeyError(f"no service account {email}")
            token = f"ya29.fake-{next(self._gen)}"
            self.tokens[token] = email
            return token

    # -------------------------------------------------------------- authorization

    def _allowed(self, permission: str, bucket: str, obj: str | None = None) -> bool:
        if self._caller is None:
            return True
        name, type_ = f"projects/_/buckets/{bucket}", _BUCKET_TYPE
        if obj is not None:
            name, type_ = f"{name}/objects/{obj}", _OBJECT_TYPE
        member = f"serviceAccount:{self._caller}"
        for b in self.policies.get(bucket, {}).get("bindings") or []:
            if member not in (b.get("members") or []):
                continue
            if permission not in ROLE_PERMISSIONS.get(str(b.get("role")), set()):
                continue
            cond = b.get("condition")
            if not cond or condition_holds(str(cond.get("expression", "")), name, type_):
                return True
        return False

    def _need(self, permission: str, bucket: str, obj: str | None = None) -> None:
        if self._caller is not None and bucket in self.buckets \
                and not self._allowed(permission, bucket, obj):  # fmt: skip
            what = "object" if obj is not None else "bucket"
            raise StorageError(403, "forbidden", f"{self._caller} does not have {permission} "
                               f"access to the Google Cloud Storage {what}. Permission "
                               f"'{permission}' denied on resource (or it may not exist).")  # fmt: skip

    def _need_write(self, bucket: str, name: str) -> None:
        """Creating `name`, or writing over it: that needs delete too, as GCS says."""
        if any(r in name for r in self.refuse_names):
            raise StorageError(403, "forbidden", f"writing {name} is refused (injected)")
        self._need("storage.objects.create", bucket, name)
        if name in self.objects.get(bucket, {}):
            self._need("storage.objects.delete", bucket, name)

    def _authenticate(self, headers: Any) -> None:
        auth = str(headers.get("Authorization") or "")
        self._caller = None
        if not auth:
            return
        kind, _, token = auth.partition(" ")
        email = self.tokens.get(token) if kind.lower() == "bearer" else None
        if email is None or email not in self.service_accounts:
            raise StorageError(401, "authError", "Invalid Credentials")
        self._caller = email

    # -------------------------------------------------------------- dispatch

    @staticmethod
    def serves(path: str) -> bool:
        p = urlsplit(path).path
        return p.startswith(("/storage/", "/upload/storage/", "/download/storage/")) or bool(
            re.match(_SA, p)
            or re.match(r"/v1/projects/[^/:]+/roles(/|$)", p)
            or re.fullmatch(r"/v1/projects/[^/:]+:(getIamPolicy|setIamPolicy|getEffectiveOrgPolicy)", p)
        )

    def handle(self, method: str, raw_path: str, headers: Any, raw: bytes) -> Reply:
        from .fake_compute import Recorded

        url = urlsplit(raw_path)
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        found = next(
            (
                (key, mt)
                for m, key, rx in STORAGE_ROUTES
                if m == method and (mt := rx.match(url.path))
            ),
            None,
        )
        iam = url.path.startswith("/v1/")
        if found is None:
            return self._error(StorageError(404, "notFound", f"no route {method} {url.path}", iam))
        key, match = found
        args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        ctype = str(headers.get("Content-Type") or "")
        body: Any = None
        if raw and ctype.startswith("application/json"):
            body = json.loads(raw)
        with self.compute._lock:
            self.compute.requests.append(Recorded(method, key, url.path, query, body))
            try:
                self.compute._inject(key)
                self._authenticate(headers)
                self.callers.append((key, self._caller))
                if self._caller is not None and (key in (
                        "storage.buckets.insert", "iam.serviceAccounts.create",
                        "iam.serviceAccounts.get", "iam.serviceAccounts.delete")
                        or key.startswith("iam.roles.")
                        or key.endswith("IamPolicy") and not key.startswith("storage.")):  # fmt: skip
                    perm = key.replace("buckets.insert", "buckets.create")
                    raise StorageError(403, "forbidden", f"{self._caller} does not have "
                                       f"{perm} access to the project.")  # fmt: skip
                if key in _BUCKET_PERMISSION:
                    self._need(_BUCKET_PERMISSION[key], args["bucket"])
                handler = getattr(self, "_" + key.split(".", 1)[1].replace(".", "_"))
                return handler(query=query, headers=headers, raw=raw, body=body, **args)
            except StorageError as e:
                e.iam = iam
                return self._error(e)
            finally:
                self._caller = None

    @staticmethod
    def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
        h = {"Content-Type": "application/json; charset=UTF-8", **(headers or {})}
        return status, h, json.dumps(obj).encode()

    def _error(self, e: StorageError) -> Reply:
        return self._json(e.body(), e.status)

    # -------------------------------------------------------------- buckets

    def _bucket(self, bucket: str) -> dict[str, Any]:
        if bucket in self.foreign_buckets:
            raise StorageError(403, "forbidden", "caller does not have storage.buckets.get "
                               f"access to the Google Cloud Storage bucket {bucket}.")  # fmt: skip
        if bucket not in self.buckets:
            raise StorageError(404, "notFound", "The specified bucket does not exist.")
        return self.buckets[bucket]

    def _buckets_insert(self, query: dict[str, str], body: Any, **_: Any) -> Reply:
        project = query.get("project", "")
        if not project:
            raise StorageError(400, "required", "Required parameter: project")
        name = str((body or {}).get("name", ""))
        if (
            not BUCKET_RE.fullmatch(name)
            or name.startswith("goog")
            or "google" in name
            or ".." in name
        ):
            raise StorageError(400, "invalid", f"Invalid bucket name: '{name}'")
        if name in self.foreign_buckets:
            raise StorageError(409, "conflict", "The requested bucket name is not available. "
                               "The bucket namespace is shared by all users of the system. "
                               "Please select a different name and try again.")  # fmt: skip
        if name in self.buckets:
            raise StorageError(409, "conflict", "Your previous request to create the named "
                               "bucket succeeded and you already own it.")  # fmt: skip
        iam_cfg = dict(body.get("iamConfiguration") or {})
        ubla = dict(iam_cfg.get("uniformBucketLevelAccess") or {})
        iam_cfg["uniformBucketLevelAccess"] = {"enabled": bool(ubla.get("enabled"))}
        iam_cfg.setdefault("publicAccessPrevention", "inherited")
        res = {
            "kind": "storage#bucket", "id": name, "name": name,
            "projectNumber": "123456789012", "project": project,
            "location": str(body.get("location") or "US").upper(),
            "storageClass": body.get("storageClass", "STANDARD"),
            "labels": dict(body.get("labels") or {}), "iamConfiguration": iam_cfg,
            "timeCreated": _now(), "updated": _now(), "metageneration": "1",
            "etag": "CAE=",
        }  # fmt: skip
        self.buckets[name] = res
        self.objects[name] = {}
        self.policies[name] = {
            "kind": "storage#policy", "resourceId": f"projects/_/buckets/{name}",
            "version": 1, "etag": "CAE=",
            "bindings": [
                {"role": "roles/storage.legacyBucketOwner",
                 "members": [f"projectEditor:{project}", f"projectOwner:{project}"]},
                {"role": "roles/storage.legacyBucketReader",
                 "members": [f"projectViewer:{project}"]},
            ],
        }  # fmt: skip
        return self._json(res)

    def _buckets_get(self, bucket: str, **_: Any) -> Reply:
        return self._json(self._bucket(bucket))

    def _buckets_delete(self, bucket: str, **_: Any) -> Reply:
        self._bucket(bucket)
        if self.objects[bucket]:
            raise StorageError(409, "conflict", "The bucket you tried to delete is not empty.")
        del self.buckets[bucket], self.objects[bucket], self.policies[bucket]
        return 204, {}, b""

    def _buckets_getIamPolicy(self, bucket: str, query: dict[str, str], **_: Any) -> Reply:
        self._bucket(bucket)
        pol = self.policies[bucket]
        want = int(query.get("optionsRequestedPolicyVersion") or 1)
        if want < 3 and any(b.get("condition") for b in pol["bindings"]):
            raise StorageError(400, "invalid", "The policy has conditions: request policy "
                               "version 3 (optionsRequestedPolicyVersion=3) to read it.")  # fmt: skip
        return self._json(json.loads(json.dumps(pol)))

    def _buckets_setIamPolicy(self, bucket: str, body: Any, **_: Any) -> Reply:
        b = self._bucket(bucket)
        old = self.policies[bucket]
        body = body or {}
        if body.get("etag") and body["etag"] != old["etag"]:
            raise StorageError(412, "conditionNotMet", "At least one of the pre-conditions "
                               "you specified did not hold.")  # fmt: skip
        bindings = list(body.get("bindings") or [])
        version = int(body.get("version") or 1)
        for i, bd in enumerate(bindings):
            self._check_binding(bd, "invalid")
            if bd.get("condition"):
                if version < 3:
                    raise StorageError(400, "invalid", f"bindings[{i}]: IAM conditions need "
                                       "policy version 3.")  # fmt: skip
                if not b["iamConfiguration"]["uniformBucketLevelAccess"]["enabled"]:
                    raise StorageError(400, "invalid", "IAM conditions can only be used on "
                                       "buckets with uniform bucket-level access enabled.")  # fmt: skip
                if not str(bd["condition"].get("expression", "")).strip():
                    raise StorageError(400, "invalid", f"bindings[{i}].condition: empty "
                                       "expression.")  # fmt: skip
                if bad := undeclared_function(str(bd["condition"]["expression"])):
                    raise StorageError(400, "invalid", f"bindings[{i}].condition: "
                                       f"undeclared reference to '{bad}'")  # fmt: skip
        n = int.from_bytes(base64.b64decode(old["etag"]), "big") + 1
        pol = {"kind": "storage#policy", "resourceId": f"projects/_/buckets/{bucket}",
               "version": version, "bindings": bindings,
               "etag": base64.b64encode(n.to_bytes(4, "big")).decode()}  # fmt: skip
        self.policies[bucket] = pol
        return self._json(pol)

    # -------------------------------------------------------------- objects

    def _object(self, bucket: str, name: str) -> tuple[bytes, dict[str, Any]]:
        self._bucket(bucket)
        if name not in self.objects[bucket]:
            raise StorageError(404, "notFound", f"No such object: {bucket}/{name}")
        return self.objects[bucket][name]

    def _store(self, bucket: str, name: str, data: bytes, ctype: str) -> dict[str, Any]:
        if not name:
            raise StorageError(400, "required", "Required parameter: name")
        gen = str(next(self._gen))
        meta = {
            "kind": "storage#object", "id": f"{bucket}/{name}/{gen}", "name": name,
            "bucket": bucket, "generation": gen, "metageneration": "1",
            "contentType": ctype or "application/octet-stream", "size": str(len(data)),
            "md5Hash": base64.b64encode(hashlib.md5(data).digest()).decode(),
            "storageClass": "STANDARD", "timeCreated": _now(), "updated": _now(),
            "etag": "CAE=",
            "selfLink": f"{self.compute.endpoint}/storage/v1/b/{bucket}/o/{name}",
            "mediaLink": f"{self.compute.endpoint}/download/storage/v1/b/{bucket}/o/{name}"
                         f"?generation={gen}&alt=media",
        }  # fmt: skip
        self.objects[bucket][name] = (bytes(data), meta)
        return meta

    def _objects_get(self, bucket: str, obj: str, query: dict[str, str], headers: Any,
                     **_: Any) -> Reply:  # fmt: skip
        self._need("storage.objects.get", bucket, obj)
        data, meta = self._object(bucket, obj)
        if query.get("alt") != "media":
            return self._json(meta)
        rng = str(headers.get("Range") or "")
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng)
        if not m or (not m.group(1) and not m.group(2)):
            return 200, {"Content-Type": meta["contentType"]}, data
        size = len(data)
        if m.group(1):
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
        else:  # bytes=-N: the last N
            start, end = max(0, size - int(m.group(2))), size - 1
        if start >= size or start > end:
            raise StorageError(416, "requestedRangeNotSatisfiable",
                               "Request range not satisfiable")  # fmt: skip
        return 206, {"Content-Type": meta["contentType"],
                     "Content-Range": f"bytes {start}-{end}/{size}"}, data[start : end + 1]  # fmt: skip

    def _objects_delete(self, bucket: str, obj: str, **_: Any) -> Reply:
        if any(r in obj for r in self.refuse_deletes):
            raise StorageError(403, "forbidden", f"deleting {obj} is refused (injected)")
        self._need("storage.objects.delete", bucket, obj)
        self._object(bucket, obj)
        del self.objects[bucket][obj]
        return 204, {}, b""

    def _objects_move(self, bucket: str, obj: str, dst: str, **_: Any) -> Reply:
        self._need("storage.objects.get", bucket, obj)
        self._need("storage.objects.delete", bucket, obj)
        self._need_write(bucket, dst)
        data, meta = self._object(bucket, obj)
        out = self._store(bucket, dst, data, meta["contentType"])
        del self.objects[bucket][obj]
        return self._json(out)

    def _objects_rewrite(self, bucket: str, obj: str, dbucket: str, dst: str, **_: Any) -> Reply:
        self._need("storage.objects.get", bucket, obj)
        self._need_write(dbucket, dst)
        data, meta = self._object(bucket, obj)
        self._bucket(dbucket)
        out = self._store(dbucket, dst, data, meta["contentType"])
        return self._json({"kind": "storage#rewriteResponse", "done": True,
                           "totalBytesRewritten": str(len(data)),
                           "objectSize": str(len(data)), "resource": out})  # fmt: skip

    def _objects_compose(self, bucket: str, dst: str, body: Any, **_: Any) -> Reply:
        """Concatenate up to 32 objects of the bucket into `dst`; as on GCS, a composite
        counts the components of its sources and holds at most 1024."""
        sources = [str(o.get("name", "")) for o in (body or {}).get("sourceObjects") or []]
        if not sources:
            raise StorageError(400, "required", "Required parameter: sourceObjects")
        if len(sources) > 32:
            raise StorageError(400, "invalid", f"The number of source components provided "
                               f"({len(sources)}) exceeds the maximum (32)")  # fmt: skip
        for name in sources:
            self._need("storage.objects.get", bucket, name)
        self._need_write(bucket, dst)
        got = [self._object(bucket, name) for name in sources]
        components = sum(int(m.get("componentCount", 1)) for _, m in got)
        if components > MAX_COMPONENTS:
            raise StorageError(400, "invalid", f"The number of components in the destination "
                               f"object ({components}) exceeds the maximum "
                               f"({MAX_COMPONENTS})")  # fmt: skip
        ctype = str(((body or {}).get("destination") or {}).get("contentType")
                    or got[0][1]["contentType"])  # fmt: skip
        meta = self._store(bucket, dst, b"".join(d for d, _ in got), ctype)
        meta["componentCount"] = components
        return self._json(meta)

    def _objects_list(self, bucket: str, query: dict[str, str], **_: Any) -> Reply:
        self._bucket(bucket)
        prefix = query.get("prefix", "")
        delim = query.get("delimiter", "")
        items: list[dict[str, Any]] = []
        prefixes: set[str] = set()
        for name in sorted(self.objects[bucket]):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            if delim and delim in rest:
                prefixes.add(prefix + rest.split(delim, 1)[0] + delim)
            else:
                items.append(self.objects[bucket][name][1])
        entries: list[tuple[str, Any]] = sorted(
            [(i["name"], i) for i in items] + [(p, None) for p in prefixes],
            key=lambda e: e[0],
        )
        start = int(query.get("pageToken") or 0)
        size = max(1, min(int(query.get("maxResults") or 1000), 1000))
        page = entries[start : start + size]
        out: dict[str, Any] = {"kind": "storage#objects"}
        if [e for _, e in page if e is not None]:
            out["items"] = [e for _, e in page if e is not None]
        if [n for n, e in page if e is None]:
            out["prefixes"] = [n for n, e in page if e is None]
        if start + size < len(entries):
            out["nextPageToken"] = str(start + size)
        return self._json(out)

    def _objects_insert(self, bucket: str, query: dict[str, str], headers: Any, raw: bytes,
                        body: Any, **_: Any) -> Reply:  # fmt: skip
        self._bucket(bucket)
        kind = query.get("uploadType", "")
        ctype = str(headers.get("Content-Type") or "")
        if kind == "media":
            self._need_write(bucket, query.get("name", ""))
            return self._json(self._store(bucket, query.get("name", ""), raw, ctype))
        if kind == "multipart":
            meta, data, dtype = _multipart(raw, ctype)
            self._need_write(bucket, str(meta.get("name", "")))
            return self._json(self._store(bucket, str(meta.get("name", "")), data, dtype))
        if kind != "resumable":
            raise StorageError(400, "invalid", f"Invalid upload type: {kind!r}")
        uid = query.get("upload_id")
        if uid is None:  # start a session
            name = str((body or {}).get("name") or query.get("name", ""))
            if not name:
                raise StorageError(400, "required", "Required parameter: name")
            self._need_write(bucket, name)
            uid = f"up{next(self._gen)}"
            self._uploads[uid] = _Upload(bucket, name, str(headers.get("X-Upload-Content-Type")
                                                            or "application/octet-stream"))  # fmt: skip
            loc = (f"{self.compute.endpoint}/upload/storage/v1/b/{bucket}/o"
                   f"?uploadType=resumable&upload_id={uid}")  # fmt: skip
            return 200, {"Location": loc, "Content-Length": "0"}, b""
        up = self._uploads.get(uid)
        if up is None:
            raise StorageError(404, "notFound", f"No such upload session: {uid}")
        cr = str(headers.get("Content-Range") or "")
        m = re.fullmatch(r"bytes (?:(\d+)-(\d+)|\*)/(\d+|\*)", cr)
        if m is None:
            raise StorageError(400, "invalid", f"Invalid Content-Range: {cr!r}")
        if m.group(1) is not None:
            first, last = int(m.group(1)), int(m.group(2))
            if first != len(up.data) or last - first + 1 != len(raw):
                raise StorageError(400, "invalid", f"chunk {cr} does not continue the upload "
                                   f"at byte {len(up.data)} ({len(raw)} bytes sent)")  # fmt: skip
            up.data += raw
        total = m.group(3)
        if total == "*":
            return 308, {"Range": f"bytes=0-{len(up.data) - 1}", "Content-Length": "0"}, b""
        if int(total) != len(up.data):
            raise StorageError(400, "invalid", f"upload ends at {total} but has {len(up.data)}")
        del self._uploads[uid]
        return self._json(self._store(up.bucket, up.name, bytes(up.data), up.content_type))

    # -------------------------------------------------------------- IAM service accounts

    def _serviceAccounts_create(self, project: str, body: Any, **_: Any) -> Reply:
        body = body or {}
        acc = str(body.get("accountId", ""))
        if not ACCOUNT_ID_RE.fullmatch(acc):
            raise StorageError(400, "INVALID_ARGUMENT", f"Invalid account id {acc!r}: it must "
                               "be 6-30 characters of lowercase letters, digits and hyphens, "
                               "start with a letter and not end with a hyphen.")  # fmt: skip
        email = f"{acc}@{project}{SA_DOMAIN}"
        if email in self.service_accounts:
            raise StorageError(409, "ALREADY_EXISTS", f"Service account {acc} already exists "
                               f"within project projects/{project}.")  # fmt: skip
        sa = dict(body.get("serviceAccount") or {})
        res = {"name": f"projects/{project}/serviceAccounts/{email}", "projectId": project,
               "uniqueId": str(next(self._gen)), "email": email,
               "displayName": sa.get("displayName", ""),
               "description": sa.get("description", "")}  # fmt: skip
        self.service_accounts[email] = res
        return self._json(res)

    def _sa(self, project: str, email: str) -> dict[str, Any]:
        sa = self.service_accounts.get(email)
        if sa is None or sa["projectId"] != project:
            raise StorageError(404, "NOT_FOUND", f"Unknown service account {email}")
        return sa

    def _check_binding(self, bd: dict[str, Any], reason: str) -> None:
        """A binding IAM takes: a role named roles/..., service accounts that exist."""
        role = str(bd.get("role", ""))
        if role.startswith("projects/") and "/roles/" in role:
            if role not in self.roles or self.roles[role].get("deleted"):
                raise StorageError(400, reason, f"Role {role} does not exist.")
        elif not role.startswith("roles/"):
            raise StorageError(400, reason, f"Role {role!r} is not a valid role.")
        for m in bd.get("members") or []:
            kind, _, who = str(m).partition(":")
            if kind == "serviceAccount" and who.endswith(SA_DOMAIN) and (
                    who not in self.service_accounts):
                raise StorageError(400, reason, f"Service account {who} does not exist.")

    def _policy_of(self, resource: str) -> dict[str, Any]:
        return self.iam_policies.setdefault(
            resource, {"version": 1, "bindings": [], "etag": base64.b64encode(b"\0\0\0\1").decode()})

    def _get_policy(self, resource: str, body: Any) -> Reply:
        pol = self._policy_of(resource)
        want = int(((body or {}).get("options") or {}).get("requestedPolicyVersion") or 1)
        if want < 3 and any(b.get("condition") for b in pol["bindings"]):
            raise StorageError(400, "INVALID_ARGUMENT", "The policy has conditions: request "
                               "policy version 3 to read it.")  # fmt: skip
        return self._json(json.loads(json.dumps(pol)))

    def _set_policy(self, resource: str, body: Any) -> Reply:
        """setIamPolicy as IAM checks it: the etag, roles named roles/..., members that
        exist, conditions only in version 3 with an expression."""
        old = self._policy_of(resource)
        new = dict((body or {}).get("policy") or {})
        if new.get("etag") and new["etag"] != old["etag"]:
            raise StorageError(409, "ABORTED", "There were concurrent policy changes.")
        version = int(new.get("version") or 1)
        bindings = list(new.get("bindings") or [])
        for i, bd in enumerate(bindings):
            self._check_binding(bd, "INVALID_ARGUMENT")
            cond = bd.get("condition")
            if cond and (version < 3 or not str(cond.get("expression", "")).strip()):
                raise StorageError(400, "INVALID_ARGUMENT", f"bindings[{i}].condition needs "
                                   "policy version 3 and an expression.")  # fmt: skip
            if cond and (bad := undeclared_function(str(cond["expression"]))):
                raise StorageError(400, "INVALID_ARGUMENT", f"bindings[{i}].condition: "
                                   f"undeclared reference to '{bad}'")  # fmt: skip
        n = int.from_bytes(base64.b64decode(old["etag"]), "big") + 1
        pol = {"version": version, "bindings": bindings,
               "etag": base64.b64encode(n.to_bytes(4, "big")).decode()}  # fmt: skip
        self.iam_policies[resource] = pol
        return self._json(pol)

    def _serviceAccounts_getIamPolicy(self, project: str, email: str, body: Any,
                                      **_: Any) -> Reply:  # fmt: skip
        self._sa(project, email)
        return self._get_policy(f"serviceAccounts/{email}", body)

    def _serviceAccounts_setIamPolicy(self, project: str, email: str, body: Any,
                                      **_: Any) -> Reply:  # fmt: skip
        self._sa(project, email)
        return self._set_policy(f"serviceAccounts/{email}", body)

    def _projects_getIamPolicy(self, project: str, body: Any, **_: Any) -> Reply:
        return self._get_policy(f"projects/{project}", body)

    def _projects_setIamPolicy(self, project: str, body: Any, **_: Any) -> Reply:
        if not self.project_iam_admin:
            raise StorageError(403, "PERMISSION_DENIED", "Policy update access denied.")
        return self._set_policy(f"projects/{project}", body)

    def _projects_getEffectiveOrgPolicy(self, project: str, body: Any, **_: Any) -> Reply:
        """A boolean constraint's effective policy: booleanPolicy.enforced when the
        organization enforces it, an empty booleanPolicy when not (as the API answers)."""
        if not self.org_policy_readable:
            raise StorageError(403, "PERMISSION_DENIED", "The caller does not have permission")
        constraint = str((body or {}).get("constraint") or "")
        if not constraint.startswith("constraints/"):
            raise StorageError(400, "INVALID_ARGUMENT", "Invalid constraint name.")
        enforced = constraint in self.org_enforced
        return self._json({"constraint": constraint,
                           "booleanPolicy": {"enforced": True} if enforced else {}})

    # -------------------------------------------------------------- IAM custom roles

    def _role(self, project: str, role: str) -> dict[str, Any]:
        found = self.roles.get(f"projects/{project}/roles/{role}")
        if found is None:
            raise StorageError(404, "NOT_FOUND", f"The role named projects/{project}/roles/"
                               f"{role} was not found.")  # fmt: skip
        return found

    def _roles_create(self, project: str, body: Any, **_: Any) -> Reply:
        """roles.create: an id of 3-64 [a-zA-Z0-9_.], one not taken (a deleted role's id
        stays taken), the permissions as given."""
        body = body or {}
        rid = str(body.get("roleId", ""))
        if not re.fullmatch(r"[a-zA-Z0-9_.]{3,64}", rid):
            raise StorageError(400, "INVALID_ARGUMENT", f"The role id {rid!r} is invalid.")
        name = f"projects/{project}/roles/{rid}"
        if name in self.roles:
            raise StorageError(409, "ALREADY_EXISTS", f"A role named {rid} in projects/"
                               f"{project} already exists.")  # fmt: skip
        role = dict(body.get("role") or {})
        role.update(name=name, etag=base64.b64encode(b"\0\0\0\1").decode(), deleted=False)
        role["includedPermissions"] = list(role.get("includedPermissions") or [])
        self.roles[name] = role
        return self._json(role)

    def _roles_get(self, project: str, role: str, **_: Any) -> Reply:
        return self._json(self._role(project, role))

    def _roles_update(self, project: str, role: str, query: dict[str, str], body: Any,
                      **_: Any) -> Reply:  # fmt: skip
        have = self._role(project, role)
        if have.get("deleted"):
            raise StorageError(400, "FAILED_PRECONDITION", "You can't update a deleted role.")
        fields = [f for f in query.get("updateMask", "").split(",") if f]
        for f in fields or list((body or {}).keys()):
            if f in (body or {}):
                have[f] = body[f]
        n = int.from_bytes(base64.b64decode(have["etag"]), "big") + 1
        have["etag"] = base64.b64encode(n.to_bytes(4, "big")).decode()
        return self._json(have)

    def _roles_delete(self, project: str, role: str, **_: Any) -> Reply:
        have = self._role(project, role)
        have["deleted"] = True
        return self._json(have)

    def _roles_undelete(self, project: str, role: str, **_: Any) -> Reply:
        have = self._role(project, role)
        have["deleted"] = False
        return self._json(have)

    def _serviceAccounts_get(self, project: str, email: str, **_: Any) -> Reply:
        return self._json(self._sa(project, email))

    def _serviceAccounts_delete(self, project: str, email: str, **_: Any) -> Reply:
        self._sa(project, email)
        del self.service_accounts[email]
        self.iam_policies.pop(f"serviceAccounts/{email}", None)
        return self._json({})


class InstanceMetadata:
    """The metadata server of one VM running as the service account `email`, on loopback:
    the GCE protocol google-auth's compute-engine credentials speak (GCE_METADATA_HOST /
    GCE_METADATA_IP). Every request must carry `Metadata-Flavor: Google` (403 otherwise, as
    GCE answers); the answers carry it too. Serves the project id, the account's info and
    an access token issued by `storage` (FakeStorage.issue_token)."""

    def __init__(self, storage: FakeStorage, email: str, project: str):
        md = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = urlsplit(self.path).path.rstrip("/")
                code, ctype, out = md.answer(path, self.headers.get("Metadata-Flavor"))
                body = out.encode()
                self.send_response(code)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.storage, self.email, self.project = storage, email, project
        self.tokens_issued = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._server.server_port}"

    def answer(self, path: str, flavor: str | None) -> tuple[int, str, str]:
        if path == "":
            return 200, "application/text", "computeMetadata/\n"
        if flavor != "Google":
            return 403, "text/html", "Missing Metadata-Flavor:Google header."
        sa = "/computeMetadata/v1/instance/service-accounts/default"
        if path == "/computeMetadata/v1/project/project-id":
            return 200, "application/text", self.project
        if path == sa:
            return 200, "application/json", json.dumps({
                "aliases": ["default"], "email": self.email,
                "scopes": ["https://www.googleapis.com/auth/cloud-platform"]})
        if path == sa + "/email":
            return 200, "application/text", self.email
        if path == sa + "/token":
            self.tokens_issued += 1
            return 200, "application/json", json.dumps({
                "access_token": self.storage.issue_token(self.email), "expires_in": 3599,
                "token_type": "Bearer"})
        if path == "/computeMetadata/v1/universe/universe-domain":
            return 200, "application/text", "googleapis.com"
        return 404, "text/html", "Not Found"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


def _multipart(raw: bytes, ctype: str) -> tuple[dict[str, Any], bytes, str]:
    """(metadata, data, data content type) of a multipart/related upload body."""
    m = re.search(r'boundary="?([^";]+)"?', ctype)
    if not ctype.startswith("multipart/related") or m is None:
        raise StorageError(400, "invalid", f"multipart upload with Content-Type {ctype!r}")
    sep = b"--" + m.group(1).encode()
    parts = raw.split(sep)
    if len(parts) < 4 or not parts[-1].lstrip().startswith(b"--"):
        raise StorageError(400, "invalid", "malformed multipart body")
    # the body's line break (gcsfs writes "\n", RFC 2046 says CRLF): the one before each
    # delimiter belongs to it, and only that one comes off a part's content (data that
    # ends in "\r" keeps it)
    eol = b"\r\n" if parts[1].startswith(b"\r\n") else b"\n"
    out: list[tuple[dict[str, str], bytes]] = []
    for part in parts[1:-1]:
        if part.startswith(eol):
            part = part[len(eol):]
        head, content = _split_head(part)
        hdrs = {}
        for line in head.decode().splitlines():
            k, _, v = line.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        if content.endswith(eol):
            content = content[: -len(eol)]
        out.append((hdrs, content))
    if len(out) != 2:
        raise StorageError(400, "invalid", f"multipart upload with {len(out)} parts (want 2)")
    meta = json.loads(out[0][1] or b"{}")
    return meta, out[1][1], out[1][0].get("content-type", "application/octet-stream")


def _split_head(part: bytes) -> tuple[bytes, bytes]:
    m = re.search(rb"\r?\n\r?\n", part)
    if m is None:
        raise StorageError(400, "invalid", "multipart part without headers")
    return part[: m.start()], part[m.end() :]


_GCS_ENV = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
            "SPOTCTL_CHECKPOINT_STORAGE_OPTIONS")  # fmt: skip


@contextmanager
def fake_gcs(bucket: str = "ckpts", project: str = "test-proj") -> Iterator[dict[str, str]]:
    """fake_gcs_server's environment alone."""
    with fake_gcs_server(bucket, project) as (_, env):
        yield env


@contextmanager
def fake_gcs_server(bucket: str = "ckpts", project: str = "test-proj"
                    ) -> Iterator[tuple[FakeCompute, dict[str, str]]]:
    """Start the fake GCP server, create `bucket` in it, and set the environment (this
    process and the children it starts) so that gcsfs talks to it: STORAGE_EMULATOR_HOST
    (gcsfs's own emulator switch), anonymous credentials through spotctl's
    SPOTCTL_CHECKPOINT_STORAGE_OPTIONS, and gcsfs's gRPC bucket-layout probe off (it
    would speak gRPC to a JSON endpoint). Yields the server and that environment."""
    import os

    from .fake_compute import FakeCompute

    with FakeCompute() as fake:
        env = {"STORAGE_EMULATOR_HOST": fake.endpoint,
               "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
               "SPOTCTL_CHECKPOINT_STORAGE_OPTIONS": json.dumps({"token": "anon",
                                                                 "project": project})}  # fmt: skip
        saved = {k: os.environ.get(k) for k in _GCS_ENV}
        os.environ.update(env)
        # gcsfs picks its class when imported: a process that imported it before this
        # environment was set gets the plain GCSFileSystem registered here (spawned
        # children import it afresh under the environment).
        import fsspec
        from gcsfs.core import GCSFileSystem

        for proto in ("gs", "gcs"):
            fsspec.register_implementation(proto, GCSFileSystem, clobber=True)
        try:
            code, _, out = fake.storage.handle(
                "POST", f"/storage/v1/b?project={project}",
                {"Content-Type": "application/json"}, json.dumps({"name": bucket}).encode(),
            )  # fmt: skip
            assert code == 200, out
            yield fake, env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
