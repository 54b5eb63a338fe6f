"""`spotctl check --provider gcp` against the fake Compute API."""

from __future__ import annotations

import sys

import pytest

from spotctl.providers.gcp.provider import GcpProvider

from .conftest import PROJECT, make_ctx

pytestmark = pytest.mark.gcp


def _checks(p: GcpProvider) -> dict[str, object]:
    return {c.name: c for c in p.checks()}


def test_new_project_without_spot_gpu_quota_is_blocked_with_the_metric(fake, spotctl_home):
    p = GcpProvider(make_ctx(fake, spotctl_home, gpu="T4"))
    checks = {c.name: c for c in p.checks()}
    assert list(checks) == ["credentials", "region", "spot GPU quota", "network",
                            "SSH login", "GPU network", "image (workers)", "image (head)",
                            "launch request", "head's rights", "checkpoint bucket"]  # fmt: skip
    assert checks["credentials"].ok and PROJECT in checks["credentials"].detail
    assert checks["region"].ok and "4 zones" in checks["region"].detail
    q = checks["spot GPU quota"]
    assert not q.ok and q.blocking
    # no preemptible quota granted: Spot VMs count against the standard one
    assert "NVIDIA_T4_GPUS 0, 0 in use (1 needed for gpus.min 1)" in q.detail
    assert "PREEMPTIBLE_" not in q.detail
    assert checks["network"].ok and "subnetwork default in us-central1" in checks["network"].detail
    assert checks["image (workers)"].ok and "disk >= 50 GB" in checks["image (workers)"].detail
    assert checks["image (head)"].ok and "debian-12" in checks["image (head)"].detail
    fake.region_quotas["PREEMPTIBLE_NVIDIA_T4_GPUS"] = 8
    fake.project_quotas["GPUS_ALL_REGIONS"] = 8
    assert {c.name: c for c in p.checks()}["spot GPU quota"].ok


def test_spot_vms_use_standard_gpu_quota_unless_preemptible_quota_was_granted(
    fake, spotctl_home
):
    """Compute Engine docs, "Allocation quotas" (preemptible quotas) and "Create and use
    Spot VMs": Spot VMs consume preemptible quota where the project was granted some, and
    standard quota otherwise; Compute Engine lists PREEMPTIBLE_* at limit 0 where none was
    granted. The fake's inserts count the same way (gpu_quota on)."""
    from spotctl.errors import QuotaError

    p = GcpProvider(make_ctx(fake, spotctl_home, gpu="T4"))
    fake.project_quotas["GPUS_ALL_REGIONS"] = 8
    fake.region_quotas["NVIDIA_T4_GPUS"] = 8  # standard quota only
    q = _checks(p)["spot GPU quota"]
    assert q.ok, q
    assert q.detail.startswith("NVIDIA_T4_GPUS 8, 0 in use"), q.detail
    fake.gpu_quota = True
    [offer] = [o for o in p.offers() if o.zone == "us-central1-a" and o.gpus == 1][:1]
    assert p.launch(offer, 1, "r-standard")  # counted against the standard quota
    assert fake.quota_usage["NVIDIA_T4_GPUS"] == 1
    # a grant of preemptible quota takes over: 1 is less than gpus.min's 1 + what runs
    fake.region_quotas["PREEMPTIBLE_NVIDIA_T4_GPUS"] = 1
    fake.quota_usage["PREEMPTIBLE_NVIDIA_T4_GPUS"] = 1
    q = _checks(p)["spot GPU quota"]
    assert not q.ok and q.detail.startswith("PREEMPTIBLE_NVIDIA_T4_GPUS 1, 1 in use"), q.detail
    with pytest.raises(QuotaError, match="PREEMPTIBLE_NVIDIA_T4_GPUS"):
        p.launch(offer, 1, "r-preemptible")


def test_gpu_network_names_each_machine_types_network_and_needs_an_image_with_gvnic(
    fake, spotctl_home
):
    p = GcpProvider(make_ctx(fake, spotctl_home, machine_types=["g2-standard-4", "n1-standard-8"]))
    net = _checks(p)["GPU network"]
    assert net.ok, net
    assert net.detail == ("g2-standard-4: gVNIC, compact placement; "
                          "n1-standard-8: gVNIC (no compact placement for this family)")
    # an image made before gVNIC: GCP would refuse each gVNIC VM from it, so check blocks
    old = "projects/spotctl-test/global/images/family/no-gvnic"
    bad = _checks(GcpProvider(make_ctx(fake, spotctl_home, machine_types=["g2-standard-4"],
                                       image=old)))["GPU network"]
    assert not bad.ok and bad.blocking, bad
    assert bad.detail.startswith(f"gcp.image {old}: its guestOsFeatures have no GVNIC, and "
                                 "g2-standard-4 get gVNIC")


def test_the_fake_refuses_a_gvnic_vm_from_an_image_without_gvnic(fake, spotctl_home):
    from spotctl.errors import ProviderError

    old = "projects/spotctl-test/global/images/family/no-gvnic"
    p = GcpProvider(make_ctx(fake, spotctl_home, machine_types=["g2-standard-4"], image=old))
    [offer] = [o for o in p.offers() if o.zone == "us-central1-a"][:1]
    with pytest.raises(ProviderError, match="does not support the gVNIC network interface"):
        p.launch(offer, 1, "r-old-image")


def test_gpu_quota_is_for_gpus_min_minus_usage_in_the_region_and_project_wide(
    fake, spotctl_home
):
    p = GcpProvider(make_ctx(fake, spotctl_home, gpu="T4"))
    p.ctx.spec.gpus = "4..8"
    fake.region_quotas["PREEMPTIBLE_NVIDIA_T4_GPUS"] = 6
    # a new project: GPUS_ALL_REGIONS 0 stops every GPU VM, whatever the region allows
    q = _checks(p)["spot GPU quota"]
    assert not q.ok and q.blocking
    assert "PREEMPTIBLE_NVIDIA_T4_GPUS 6, 0 in use (4 needed for gpus.min 4)" in q.detail
    assert "GPUS_ALL_REGIONS 0, 0 in use (project-wide, 4 needed)" in q.detail
    assert q.detail.endswith("request more in IAM & Admin > Quotas: GPUS_ALL_REGIONS (global)")
    fake.project_quotas["GPUS_ALL_REGIONS"] = 4
    assert _checks(p)["spot GPU quota"].ok
    # what other VMs use counts against both limits
    fake.quota_usage["PREEMPTIBLE_NVIDIA_T4_GPUS"] = 3
    q = _checks(p)["spot GPU quota"]
    assert not q.ok and "PREEMPTIBLE_NVIDIA_T4_GPUS 6, 3 in use" in q.detail
    assert q.detail.endswith("Quotas: the Spot GPU quota of us-central1")
    fake.quota_usage["PREEMPTIBLE_NVIDIA_T4_GPUS"] = 0
    fake.quota_usage["GPUS_ALL_REGIONS"] = 1
    assert not _checks(p)["spot GPU quota"].ok


def test_a_disabled_compute_api_is_named_with_the_command_not_as_missing_roles(
    fake, spotctl_home, monkeypatch
):
    from spotctl.control.check import blocking_failures, check_account

    fake.compute_api_disabled = True
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # not installed
    ctx = make_ctx(fake, spotctl_home, ssh_cidr="")
    checks = check_account("gcp", ctx.spec, dict(ctx.options),
                           lookup=lambda: ("192.0.2.8", "a test"))  # fmt: skip
    failed = {c.name: c.detail for c in blocking_failures(checks)}
    assert list(failed) == ["credentials", "storage extra"]
    assert failed["credentials"] == (
        f"gcp: project {PROJECT}: the Compute Engine API is disabled (enable it: gcloud "
        f"services enable compute.googleapis.com --project {PROJECT})")
    assert "roles" not in failed["credentials"]
    assert "gs:// (the default on gcp) need gcsfs" in failed["storage extra"]
    assert [c.name for c in checks][-1] == "ssh_cidr" and checks[-1].ok
    # launches say the same, not "permission denied ... roles"
    from spotctl.errors import AuthError

    with pytest.raises(AuthError, match="Compute Engine API is disabled .*gcloud services "
                                        "enable compute.googleapis.com"):
        GcpProvider(make_ctx(fake, spotctl_home)).list("demo")


def test_missing_network_image_and_region_each_fail_their_line(fake, spotctl_home):
    fake.networks.clear()
    p = GcpProvider(make_ctx(fake, spotctl_home, image="projects/nope/global/images/family/x"))
    checks = {c.name: c for c in p.checks()}
    assert not checks["network"].ok and "gcloud compute networks create" in checks["network"].detail
    assert not checks["image (workers)"].ok and "gcp.image" in checks["image (workers)"].detail
    bad_region = GcpProvider(make_ctx(fake, spotctl_home, region="nowhere"))
    r = {c.name: c for c in bad_region.checks()}["region"]
    assert not r.ok and "gcp.region" in r.detail and "\n" not in r.detail


def test_an_organization_that_enforces_os_login_is_refused_before_anything_is_made(
    fake, spotctl_home
):
    """constraints/compute.requireOsLogin (common in companies' organizations) makes every
    VM ignore metadata SSH keys, the key spotctl bootstraps nodes with: `up` would launch
    and then fail at every node's first login. `check` and `up` say so in one line first."""
    from spotctl.errors import SpecError

    p = GcpProvider(make_ctx(fake, spotctl_home))
    assert _checks(p)["SSH login"].ok
    assert "not enforced" in _checks(p)["SSH login"].detail
    fake.storage.org_enforced.add("constraints/compute.requireOsLogin")
    line = _checks(p)["SSH login"]
    assert not line.ok and line.blocking and "enforces OS Login" in line.detail, line
    n = len(fake.requests)
    with pytest.raises(SpecError, match=r"^gcp: project .* enforces OS Login") as e:
        p.prepare()
    assert "\n" not in str(e.value)
    made = [r.key for r in fake.requests[n:] if r.key and not r.key.endswith(
        ("getEffectiveOrgPolicy", ".get", ".list", "aggregatedList"))]
    assert made == [], made  # no firewall, key, bucket or account
    # an identity that may not read the policy: `check` says it cannot tell, `up` goes on
    fake.storage.org_policy_readable = False
    line = _checks(p)["SSH login"]
    assert line.ok and "could not be read" in line.detail, line
    p.prepare()


def test_a_worker_image_whose_torch_and_driver_are_too_old_blocks(fake, spotctl_home):
    """The PyTorch 2.7 Deep Learning VM (driver 570): nodes would not use its torch, and the
    pinned torch they would install needs driver 580, so `up` is stopped here."""
    old = ("projects/deeplearning-platform-release/global/images/family/"
           "pytorch-2-7-cu128-ubuntu-2204-nvidia-570")
    img = _checks(GcpProvider(make_ctx(fake, spotctl_home, image=old)))["image (workers)"]
    assert not img.ok and img.blocking, img
    assert "its PyTorch 2.7 is older than 2.9" in img.detail, img
    assert "the image's is 570" in img.detail, img
    # the default image: nothing to say
    img = _checks(GcpProvider(make_ctx(fake, spotctl_home)))["image (workers)"]
    assert img.ok and img.detail == "pytorch-2-9-cu129-ubuntu-2404-nvidia-580-v20251105 (disk >= 50 GB)"


def test_check_shows_the_insert_up_would_send_and_up_dry_run_the_same(
    fake, spotctl_home, tmp_path, monkeypatch
):
    """One launch request, two uses, as far as the Compute API allows (it has no dry run
    for instances.insert): `check` builds the insert body of the first plan's launch with
    `up`'s own code, and `up --dry-run --json` shows the same body."""
    import json

    from typer.testing import CliRunner

    from spotctl.cli.app import app

    monkeypatch.setenv("SPOTCTL_GCP_ENDPOINT", fake.endpoint)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "spotctl.toml").write_text(
        'name = "a2check"\nprovider = "gcp"\ngpus = "1..1"\n'
        f'[gcp]\nproject = "{PROJECT}"\nregion = "us-central1"\nzones = ["us-central1-a"]\n'
        'machine_types = ["a2-highgpu-1g"]\nssh_cidr = "198.51.100.7/32"\n')
    up = CliRunner().invoke(app, ["up", "--dry-run", "--json"])
    assert up.exit_code == 0, up.output
    (launch,) = json.loads(up.stdout)["actions"]
    sent = launch["request"]
    checked = CliRunner().invoke(app, ["check", "--provider", "gcp", "--json"])
    line = {c["name"]: c for c in json.loads(checked.stdout)["checks"]}["launch request"]
    assert line["ok"], line
    assert line["data"]["request"] == sent
    inst = sent["instance"]
    assert inst["labels"]["spotctl-cluster"] == "a2check"
    assert inst["scheduling"]["provisioningModel"] == "SPOT"
    assert inst["resourcePolicies"] == [
        f"projects/{PROJECT}/regions/us-central1/resourcePolicies/spotctl-a2check-us-central1-a"]
    assert inst["networkInterfaces"][0]["nicType"] == "GVNIC"
    assert inst["serviceAccounts"][0]["email"].startswith("spotctl-")
    # nothing was made: no VM, no policy, no key
    assert not fake.calls("instances.insert") and not fake.calls("resourcePolicies.insert")
