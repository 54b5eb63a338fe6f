"""GCP checkpoint storage against the fake Storage + IAM server: the bucket per project and
region (uniform access, public access prevented), the cluster's gs:// prefix as the
default checkpoint_dir, a per-cluster service account bound to that prefix by an IAM
condition and attached to the workers (not the head), `down` removing the account and its
bindings and keeping the checkpoints unless purged; gcp.bucket; `check`'s bucket line;
what the fake refuses as GCP does."""

from __future__ import annotations

import json

import pytest

from spotctl.errors import SpecError
from spotctl.providers.gcp.provider import GcpProvider
from spotctl.providers.gcp.storage import (
    CLOUD_SCOPE,
    LIST_ROLE,
    OBJECT_ROLE,
    account_id_for,
    bucket_name_for,
)

from .conftest import PROJECT, make_ctx

pytestmark = pytest.mark.gcp

BUCKET = f"spotctl-{PROJECT}-us-central1"


def _offer(p: GcpProvider):
    return next(o for o in p.offers() if o.gpus == 1)


def _put(fake, bucket: str, name: str, data: bytes = b"x") -> None:
    code, _, out = fake.storage.handle(
        "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}",
        {"Content-Type": "application/octet-stream"}, data,
    )  # fmt: skip
    assert code == 200, out


def _bindings(fake, bucket: str, member: str) -> list[dict]:
    return [b for b in fake.storage.policies[bucket]["bindings"] if member in b["members"]]


def test_up_makes_bucket_prefix_and_scoped_account_and_down_keeps_checkpoints(
    fake, spotctl_home
):
    p = GcpProvider(make_ctx(fake, spotctl_home))
    assert p.ctx.spec.train.checkpoint_dir == ""
    p.prepare()
    p.prepare()  # idempotent
    b = fake.storage.buckets[BUCKET]
    assert b["iamConfiguration"]["uniformBucketLevelAccess"]["enabled"] is True
    assert b["iamConfiguration"]["publicAccessPrevention"] == "enforced"
    assert b["location"] == "US-CENTRAL1"
    assert p.ctx.spec.train.checkpoint_dir == f"gs://{BUCKET}/demo/checkpoints"
    email = f"spotctl-demo@{PROJECT}.iam.gserviceaccount.com"
    assert email in fake.storage.service_accounts
    member = f"serviceAccount:{email}"
    mine = _bindings(fake, BUCKET, member)
    assert fake.storage.policies[BUCKET]["version"] == 3
    assert sorted(x["role"] for x in mine) == sorted([OBJECT_ROLE, LIST_ROLE])
    obj = next(x for x in mine if x["role"] == OBJECT_ROLE)
    assert obj["condition"]["expression"] == (
        f'resource.name.startsWith("projects/_/buckets/{BUCKET}/objects/demo/")'
    )
    assert "condition" not in next(x for x in mine if x["role"] == LIST_ROLE)
    # the project's own bindings are kept, ours are not duplicated by a second prepare
    assert any(x["role"] == "roles/storage.legacyBucketOwner"
               for x in fake.storage.policies[BUCKET]["bindings"])  # fmt: skip
    assert len(mine) == 2

    # workers run as the account with the cloud-platform scope; the head as its own
    p.ensure_head()
    p.launch(_offer(p), 2, "req-sa")
    inserts = {c.body["name"]: c.body for c in fake.calls("instances.insert")}
    head = inserts.pop("demo-head")
    assert head["serviceAccounts"] == [{"email": p.head_account, "scopes": [CLOUD_SCOPE]}]
    assert len(inserts) == 2
    for body in inserts.values():
        assert body["serviceAccounts"] == [{"email": email, "scopes": [CLOUD_SCOPE]}]

    _put(fake, BUCKET, "demo/checkpoints/step-00000010/COMMIT")
    _put(fake, BUCKET, "other/checkpoints/step-00000010/COMMIT")
    assert p._key_path().exists()
    assert p.cleanup() == []
    assert not p._key_path().exists()  # a clean down leaves no private key
    assert p.purged is None
    assert email not in fake.storage.service_accounts
    assert _bindings(fake, BUCKET, member) == []
    assert "demo/checkpoints/step-00000010/COMMIT" in fake.storage.objects[BUCKET]
    assert p.cleanup() == []  # a second down finds nothing and is fine


def test_purge_deletes_the_cluster_prefix_only(fake, spotctl_home):
    p = GcpProvider(make_ctx(fake, spotctl_home))
    p.prepare()
    for i in range(3):
        _put(fake, BUCKET, f"demo/checkpoints/step-0000001{i}/x")
    _put(fake, BUCKET, "demo-2/checkpoints/keep")
    _put(fake, BUCKET, "other/keep")
    p.ctx.options["purge"] = True
    assert p.cleanup() == []
    assert p.purged == 3
    assert p.purge_checkpoints() == 0  # nothing left under the prefix
    assert sorted(fake.storage.objects[BUCKET]) == ["demo-2/checkpoints/keep", "other/keep"]


def test_given_bucket_must_exist_and_an_explicit_checkpoint_dir_wins(fake, spotctl_home):
    p = GcpProvider(make_ctx(fake, spotctl_home, bucket="my-ckpts"))
    with pytest.raises(SpecError, match="gcp.bucket: bucket my-ckpts does not exist"):
        p.prepare_storage()
    assert "my-ckpts" not in fake.storage.buckets
    fake.storage.handle("POST", f"/storage/v1/b?project={PROJECT}",
                        {"Content-Type": "application/json"},
                        json.dumps({"name": "my-ckpts", "iamConfiguration": {
                            "uniformBucketLevelAccess": {"enabled": True}}}).encode())  # fmt: skip
    p.ctx.spec.train.checkpoint_dir = "gs://elsewhere/run"
    p.prepare_storage()
    assert p.ctx.spec.train.checkpoint_dir == "gs://elsewhere/run"
    assert _bindings(fake, "my-ckpts", f"serviceAccount:{p.node_account}")
    assert BUCKET not in fake.storage.buckets


def test_bucket_without_uniform_access_or_taken_is_refused_in_one_line(fake, spotctl_home):
    fake.storage.handle("POST", f"/storage/v1/b?project={PROJECT}",
                        {"Content-Type": "application/json"},
                        json.dumps({"name": "acl-bucket"}).encode())  # fmt: skip
    p = GcpProvider(make_ctx(fake, spotctl_home, bucket="acl-bucket"))
    with pytest.raises(SpecError, match="no uniform bucket-level access"):
        p.prepare_storage()
    fake.storage.foreign_buckets.add(BUCKET)
    q = GcpProvider(make_ctx(fake, spotctl_home))
    with pytest.raises(SpecError, match="cannot read it") as e:
        q.prepare_storage()
    assert "\n" not in str(e.value)
    assert not fake.storage.service_accounts


def test_check_bucket_line_reachable_will_be_created_or_blocked(fake, spotctl_home):
    def line(**gcp):
        p = GcpProvider(make_ctx(fake, spotctl_home, **gcp))
        return {c.name: c for c in p.checks()}["checkpoint bucket"]

    c = line()
    assert c.ok and "created on first up" in c.detail and f"gs://{BUCKET}/demo/" in c.detail
    assert BUCKET not in fake.storage.buckets  # check creates nothing
    GcpProvider(make_ctx(fake, spotctl_home)).prepare()
    c = line()
    assert c.ok and "bucket reachable" in c.detail
    c = line(bucket="missing-bucket")
    assert not c.ok and c.blocking and "does not exist" in c.detail
    c = line(project="my-google-proj")  # the default name would hold "google"
    assert not c.ok and "not a valid bucket name" in c.detail and "reserved" in c.detail
    fake.storage.foreign_buckets.add("theirs")
    c = line(bucket="theirs")
    assert not c.ok and "cannot read it" in c.detail and "\n" not in c.detail


def test_a_bucket_name_gcs_refuses_is_a_spec_error_at_load(tmp_path):
    from spotctl.spec import load_spec

    f = tmp_path / "spotctl.toml"
    for bad in ("Bad_Name", "ab", "goog-ckpts"):
        f.write_text(f'name = "c"\nprovider = "gcp"\n[gcp]\nbucket = "{bad}"\n')
        with pytest.raises(SpecError, match="gcp.bucket") as e:
            load_spec(f, check_script=False)
        assert "\n" not in str(e.value).strip()
    f.write_text('name = "c"\nprovider = "gcp"\n[gcp]\nbucket = "my-ckpts"\n')
    assert load_spec(f, check_script=False).gcp.bucket == "my-ckpts"


def test_names_fit_what_gcp_accepts():
    assert account_id_for("demo") == "spotctl-demo"
    long = account_id_for("a-very-long-cluster-name-for-training-runs")
    assert len(long) <= 30 and long.startswith("spotctl-a-very") and not long.endswith("-")
    assert account_id_for("x") == "spotctl-x" and len(account_id_for("x")) >= 6
    assert account_id_for("UPPER_case.1") == "spotctl-upper-case-1"
    name = bucket_name_for("p" * 30, "northamerica-northeast1")
    assert len(name) <= 63 and name.startswith("spotctl-")
    assert bucket_name_for("example.com:proj", "us-central1") == "spotctl-example-com-proj-us-central1"


def test_fake_refuses_what_gcp_refuses(fake):
    st = fake.storage
    hj = {"Content-Type": "application/json"}

    def mk(name: str) -> int:
        return st.handle("POST", f"/storage/v1/b?project={PROJECT}", hj,
                         json.dumps({"name": name}).encode())[0]  # fmt: skip

    assert [mk(n) for n in ("ab", "a" * 64, "Upper", "goog-x", "my-google-b", "-x-")] == [400] * 6
    assert mk("abc") == 200 and mk("abc") == 409
    st.foreign_buckets.add("taken")
    assert mk("taken") == 409
    assert st.handle("GET", "/storage/v1/b/taken", {}, b"")[0] == 403
    assert st.handle("GET", "/storage/v1/b/nope", {}, b"")[0] == 404
    assert st.handle("GET", "/storage/v1/b/abc/o/missing", {}, b"")[0] == 404

    def sa(acc: str) -> int:
        return st.handle("POST", f"/v1/projects/{PROJECT}/serviceAccounts", hj,
                         json.dumps({"accountId": acc}).encode())[0]  # fmt: skip

    assert [sa(a) for a in ("short", "x" * 31, "1abcdef", "abcdef-", "Abcdef")] == [400] * 5
    assert sa("abcdef") == 200 and sa("abcdef") == 409
    missing = f"nobody@{PROJECT}.iam.gserviceaccount.com"
    assert st.handle("GET", f"/v1/projects/{PROJECT}/serviceAccounts/{missing}", {}, b"")[0] == 404
    # a binding naming an account that does not exist; a condition at version 1; a stale etag
    pol = json.loads(st.handle("GET", "/storage/v1/b/abc/iam", {}, b"")[2])
    bad = dict(pol, bindings=[{"role": OBJECT_ROLE, "members": [f"serviceAccount:{missing}"]}])
    assert st.handle("PUT", "/storage/v1/b/abc/iam", hj, json.dumps(bad).encode())[0] == 400
    cond = dict(pol, bindings=[{"role": OBJECT_ROLE, "members": ["projectViewer:p"],
                                "condition": {"title": "t", "expression": "true"}}])  # fmt: skip
    assert st.handle("PUT", "/storage/v1/b/abc/iam", hj, json.dumps(cond).encode())[0] == 400
    ok = dict(pol, bindings=pol["bindings"][:1])
    assert st.handle("PUT", "/storage/v1/b/abc/iam", hj, json.dumps(ok).encode())[0] == 200
    assert st.handle("PUT", "/storage/v1/b/abc/iam", hj, json.dumps(ok).encode())[0] == 412


def test_a_vm_with_a_service_account_that_does_not_exist_is_refused(fake, spotctl_home):
    p = GcpProvider(make_ctx(fake, spotctl_home))
    p.prepare()
    del fake.storage.service_accounts[p.node_account]  # deleted behind spotctl's back
    with pytest.raises(Exception, match="does not have access to service account"):
        p.launch(_offer(p), 1, "req-gone")
    assert not [k for k in fake.instances if k[1] != "demo-head"]


def test_nodes_are_shipped_gcsfs_for_the_default_checkpoint_dir(fake, spotctl_home):
    from spotctl.remote.package import _closure, packages_for

    p = GcpProvider(make_ctx(fake, spotctl_home))
    p.prepare()
    assert packages_for(p.ctx.spec.train.checkpoint_dir) == ("gcsfs",)
    names = {str(d.metadata["Name"]).lower().replace("_", "-") for d in _closure((), ("gcsfs",))}
    assert {"gcsfs", "google-cloud-storage", "google-auth", "fsspec"} <= names, names


def test_fake_keeps_data_that_ends_in_a_line_break():
    """gcsfs's multipart upload ends the data with "\\n--boundary": only that "\\n" is the
    delimiter's (the fake once took a "\\r" of the data with it, and random checkpoint
    parts ending in one came back a byte short)."""
    pytest.importorskip("gcsfs")
    import fsspec

    from .fake_storage import fake_gcs_server

    with fake_gcs_server("ckpts") as (_, env):
        fs = fsspec.filesystem("gs", **json.loads(env["SPOTCTL_CHECKPOINT_STORAGE_OPTIONS"]))
        for i, data in enumerate([b"a\r", b"b\n", b"\r\n", b"c\r\n\r\n", b"\n", b""]):
            fs.pipe_file(f"ckpts/eol/{i}", data)
            assert fs.cat_file(f"ckpts/eol/{i}") == data, data
