"""On a cloud provider, train.checkpoint_dir must be shared storage: an object-store URI or
a path under the mount the spec declares shared; anything else is refused at load time
with the reason. URIs are never turned into local paths."""

from __future__ import annotations

import pytest

from spotctl.errors import SpecError
from spotctl.spec import load_spec


def _spec(tmp_path, provider: str, train: str):
    (tmp_path / "train.py").write_text("")
    f = tmp_path / "spotctl.toml"
    f.write_text(f'name = "c"\nprovider = "{provider}"\n[train]\nscript = "train.py"\n{train}\n')
    return load_spec(f, check_script=False)


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_cloud_refuses_a_local_checkpoint_dir(tmp_path, provider):
    with pytest.raises(SpecError, match=r"train.checkpoint_dir: on .* local path.*s3://"):
        _spec(tmp_path, provider, 'checkpoint_dir = "/data/ck"')
    with pytest.raises(SpecError, match="shared_mount"):
        _spec(tmp_path, provider, 'checkpoint_dir = "/data/ck"\nshared_mount = "/mnt/nfs"')


def test_uris_and_declared_mounts_are_accepted(tmp_path):
    assert _spec(tmp_path, "aws", 'checkpoint_dir = "s3://b/x"').train.checkpoint_dir == "s3://b/x"
    assert _spec(tmp_path, "gcp", 'checkpoint_dir = "gs://b/x/"').train.checkpoint_dir == "gs://b/x/"
    sp = _spec(tmp_path, "aws", 'checkpoint_dir = "/mnt/nfs/ck"\nshared_mount = "/mnt/nfs"')
    assert sp.train.checkpoint_dir == "/mnt/nfs/ck"
    # local clusters: a path (relative to the spec) or a URI, as given
    assert _spec(tmp_path, "local", 'checkpoint_dir = "ck"').train.checkpoint_dir == str(tmp_path / "ck")
    assert _spec(tmp_path, "local", 'checkpoint_dir = "s3://b/x"').train.checkpoint_dir == "s3://b/x"
