"""A worker's checkpoint I/O as the node's own service account, bucket IAM enforced.

`prepare` (what `up` runs) creates the bucket, the cluster's service account and its two
bindings on the bucket (objectUser under the cluster's prefix condition, legacyBucketReader
for listings). A worker process then runs as a VM with that account would: no
credentials in its environment, gcsfs's default credentials, which google-auth fetches from
the VM's metadata server (the fake's `InstanceMetadata`, over the GCE metadata protocol).
The fake GCS checks every one of its calls against the bucket's policy, as GCS does. The
worker runs spotctl's Checkpointer over gcsfs and torch.distributed.checkpoint: it saves a
small state, writes COMMIT and loads it back; then it tries what its account must not do.

What the fake's IAM does not model: project-level roles (a service account has none here),
IAM's propagation delay, and CEL beyond `resource.name.startsWith` / `resource.type ==`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spotctl.providers.gcp.provider import GcpProvider

from .conftest import PROJECT, make_ctx
from .fake_storage import InstanceMetadata

pytest.importorskip("torch")
pytest.importorskip("gcsfs")

pytestmark = pytest.mark.gcp

WORKER = r"""
import json, sys
import torch
import torch.distributed as dist
import gcsfs
from spotctl.elastic.checkpoint import Checkpointer, open_store

root, bucket = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
pg = dist.new_group(backend="gloo")
state = {"model": {"w": torch.full((1600, 1024), 3.0), "b": torch.arange(4.0)}}
ck = Checkpointer(root, keep_last=2, rank=0, pg=pg, mode="thread")
out = {"saved": bool(ck.save_sync(10, state, {"epoch": 0, "offset": 40}))}
ck.close()
out["committed"] = bool(open_store(root).committed(10))
fresh = {"model": {"w": torch.zeros(1600, 1024), "b": torch.zeros(4)}}
again = Checkpointer(root, keep_last=2, rank=0, pg=pg, mode="thread")
meta = again.load_latest(fresh)
again.close()
out["loaded"] = None if meta is None else [meta["step"], meta["offset"]]
out["same"] = all(torch.equal(fresh["model"][k], state["model"][k]) for k in ("w", "b"))
fs = gcsfs.GCSFileSystem()  # the default credentials, as spotctl's own store gets them
out["listed"] = sorted(fs.ls(f"{bucket}/other", detail=False))
refused = {}
for what, call in (
    ("write under another prefix", lambda: fs.pipe(f"{bucket}/other/x", b"x")),
    ("read under another prefix", lambda: fs.cat(f"{bucket}/other/checkpoints/COMMIT")),
    ("write at the bucket's top", lambda: fs.pipe(f"{bucket}/x", b"x")),
    ("create a bucket", lambda: fs.mkdir(f"{bucket}-two", create_parents=True)),
):
    try:
        call()
        refused[what] = ""
    except Exception as e:
        refused[what] = f"{type(e).__name__}: {e}"
out["refused"] = refused
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


def _worker_env(fake, md: InstanceMetadata, home: Path) -> dict[str, str]:
    """A worker on the VM: the fake's endpoints and nothing that names credentials."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GOOGLE_", "CLOUDSDK_", "SPOTCTL_CHECKPOINT_"))}  # fmt: skip
    env.update(STORAGE_EMULATOR_HOST=fake.endpoint, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
               GCE_METADATA_HOST=md.host, GCE_METADATA_IP=md.host, HOME=str(home),
               CLOUDSDK_CONFIG=str(home / "gcloud"),
               # parts of 5 MiB: the 6.25 MiB tensor's file goes up as parts, composed
               SPOTCTL_CHECKPOINT_PART_MB="5")  # fmt: skip
    return env


def test_node_account_saves_commits_and_loads_a_checkpoint_under_bucket_iam(
    fake, spotctl_home, tmp_path
):
    p = GcpProvider(make_ctx(fake, spotctl_home))
    p.prepare()
    root = p.ctx.spec.train.checkpoint_dir
    bucket = root.removeprefix("gs://").split("/", 1)[0]
    assert root == f"gs://{bucket}/demo/checkpoints"
    email = f"spotctl-demo@{PROJECT}.iam.gserviceaccount.com"
    fake.storage.objects[bucket]["other/checkpoints/COMMIT"] = (
        b"theirs", {"name": "other/checkpoints/COMMIT", "size": "6", "bucket": bucket,
                    "contentType": "application/octet-stream"})  # fmt: skip
    md = InstanceMetadata(fake.storage, email, PROJECT)
    try:
        fake.storage.callers.clear()
        r = subprocess.run([sys.executable, "-c", WORKER, root, bucket],
                           env=_worker_env(fake, md, tmp_path), capture_output=True,
                           text=True, timeout=180)  # fmt: skip
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-4000:]
        out = json.loads(line[len("RESULT "):])
        assert md.tokens_issued >= 1  # google-auth asked the VM's metadata server
    finally:
        md.close()
    # every call the worker made was its account's, none anonymous
    callers = {who for _, who in fake.storage.callers}
    assert callers == {email}, fake.storage.callers
    assert out["saved"] and out["committed"], out
    assert out["loaded"] == [10, 40] and out["same"], out
    assert any(n.startswith("demo/checkpoints/step-00000010/")
               for n in fake.storage.objects[bucket])  # fmt: skip
    # the big file went up in parts, composed by the node's own account, none left
    assert ("storage.objects.compose", email) in fake.storage.callers, fake.storage.callers
    assert not [n for n in fake.storage.objects[bucket] if ".part-" in n]
    # other clusters' names in a shared bucket are visible, their contents are not
    assert out["listed"] == [f"{bucket}/other/checkpoints"], out
    for what, err in out["refused"].items():
        assert "does not have storage." in err or "403" in err, (what, err)
    assert "other/x" not in fake.storage.objects[bucket]
    assert "x" not in fake.storage.objects[bucket]
    assert f"{bucket}-two" not in fake.storage.buckets
    # down removes the account: its token no longer opens anything
    token = next(t for t, e in fake.storage.tokens.items() if e == email)
    assert p.cleanup() == []
    code, _, body = fake.storage.handle(
        "GET", f"/storage/v1/b/{bucket}/o", {"Authorization": f"Bearer {token}"}, b"")
    assert code == 401, body


def test_the_fakes_bucket_iam_refuses_what_gcs_refuses(fake, spotctl_home):
    """The enforcement itself, call by call: a prefix condition grants objects under the
    prefix and never a listing; writing over an object needs delete; a token the fake did
    not issue is a 401; a condition the fake cannot evaluate is an error, not a grant."""
    p = GcpProvider(make_ctx(fake, spotctl_home))
    p.prepare()
    bucket = p.bucket_name()
    email = f"spotctl-demo@{PROJECT}.iam.gserviceaccount.com"
    member = f"serviceAccount:{email}"
    auth = {"Authorization": f"Bearer {fake.storage.issue_token(email)}",
            "Content-Type": "application/octet-stream"}  # fmt: skip

    def call(method: str, path: str, data: bytes = b"") -> int:
        return fake.storage.handle(method, path, auth, data)[0]

    up = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name="
    assert call("POST", up + "demo/a", b"1") == 200
    assert call("POST", up + "demo/a", b"2") == 200  # objectUser has delete: an overwrite
    assert call("GET", f"/storage/v1/b/{bucket}/o/demo%2Fa?alt=media") == 200
    assert call("POST", up + "demob/a", b"1") == 403  # the prefix is "demo/", not "demo"
    assert call("GET", f"/storage/v1/b/{bucket}/o?prefix=demo/") == 200  # legacyBucketReader
    assert call("GET", f"/storage/v1/b/{bucket}/iam") == 403
    assert call("DELETE", f"/storage/v1/b/{bucket}") == 403
    # without the listing binding the prefix's objectUser does not list, as on GCS
    pol = fake.storage.policies[bucket]
    pol["bindings"] = [b for b in pol["bindings"]
                       if not (member in b["members"] and not b.get("condition"))]  # fmt: skip
    assert call("GET", f"/storage/v1/b/{bucket}/o?prefix=demo/") == 403
    assert call("GET", f"/storage/v1/b/{bucket}/o/demo%2Fa?alt=media") == 200
    # objectCreator writes new objects but cannot write over one (that needs delete)
    pol["bindings"] = [{"role": "roles/storage.objectCreator", "members": [member]}]
    assert call("POST", up + "demo/b", b"1") == 200
    assert call("POST", up + "demo/b", b"2") == 403
    pol["bindings"] = [{"role": "roles/storage.objectUser", "members": [member],
                        "condition": {"expression": 'resource.name.endsWith("/a")'}}]  # fmt: skip
    assert call("GET", f"/storage/v1/b/{bucket}/o/demo%2Fa?alt=media") == 500
    bad = {"Authorization": "Bearer ya29.not-issued"}
    assert fake.storage.handle("GET", f"/storage/v1/b/{bucket}/o", bad, b"")[0] == 401
