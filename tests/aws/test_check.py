"""`spotctl check --provider aws` on moto (+ a Service Quotas fake): one line per check,
non-zero exit when something would stop `up`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from spotctl.providers.aws.provider import AwsProvider

from .conftest import REGION, FaultProxy, Rule
from .fake_quotas import FakeQuotas

pytestmark = pytest.mark.aws

MakeProvider = Callable[..., AwsProvider]


@pytest.fixture
def quotas() -> Iterator[FakeQuotas]:
    q = FakeQuotas({"L-3819A6DF": 0.0, "L-7212CCBC": 0.0})
    yield q
    q.close()


def _by_name(p: AwsProvider) -> dict[str, object]:
    return {c.name: c for c in p.checks()}


def test_zero_spot_quota_blocks_with_the_quota_codes(
    make_provider: MakeProvider, quotas: FakeQuotas
) -> None:
    p = make_provider(instance_types=["g5.xlarge", "p4d.24xlarge"],
                      options={"service_quotas_endpoint_url": quotas.url})  # fmt: skip
    checks = {c.name: c for c in p.checks()}
    assert list(checks) == ["credentials", "region", "spot GPU quota", "Elastic IP quota",
                            "network",
                            "GPU network", "image (workers)", "image (head)", "launch (dry run)",
                            "checkpoint bucket"]  # fmt: skip
    assert checks["checkpoint bucket"].ok
    assert checks["credentials"].ok and "account 123456789012" in checks["credentials"].detail
    assert checks["region"].ok and checks["network"].ok and checks["image (workers)"].ok
    assert checks["launch (dry run)"].ok and "would be allowed" in checks["launch (dry run)"].detail
    q = checks["spot GPU quota"]
    assert not q.ok and q.blocking
    # (vCPUs in use: whatever spot instances other tests left in this session's moto)
    assert re.search(r"L-3819A6DF\): 0 vCPUs, \d+ in use, gpus.min 1 needs 4 \(1 x g5.xlarge\)",
                     q.detail)  # fmt: skip
    assert re.search(r"L-7212CCBC\): 0 vCPUs, \d+ in use, gpus.min 1 needs 96 "
                     r"\(1 x p4d.24xlarge\)", q.detail)  # fmt: skip
    assert "\n" not in q.detail
    quotas.values["L-3819A6DF"] = 100_000.0
    assert {c.name: c for c in p.checks()}["spot GPU quota"].ok
    # p4d nodes (4 EFA interfaces) each hold an Elastic IP: unread, then read
    eip = checks["Elastic IP quota"]
    assert not eip.ok and not eip.blocking and "L-0263D0A3): unreadable" in eip.detail
    quotas.values["L-0263D0A3"] = 0.0
    eip = {c.name: c for c in p.checks()}["Elastic IP quota"]
    # g5.xlarge needs none, so it warns; with p4d alone it would block
    assert not eip.ok and not eip.blocking, eip
    assert re.search(r"L-0263D0A3\): 0, \d+ allocated; gpus.min 1 on p4d.24xlarge needs 1",
                     eip.detail), eip.detail
    quotas.values["L-0263D0A3"] = 10_000.0
    assert {c.name: c for c in p.checks()}["Elastic IP quota"].ok


def test_gpu_network_names_each_types_network_as_ec2_describes_it(
    make_provider: MakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = make_provider(instance_types=["g5.xlarge", "p4d.24xlarge"])
    net = _by_name(p)["GPU network"]
    assert net.ok, net  # type: ignore[attr-defined]
    assert net.detail == ("g5.xlarge: ENA (no EFA on this type); "  # type: ignore[attr-defined]
                          "p4d.24xlarge: EFA x4, cluster placement group, Elastic IP")
    # spotctl's table asking for more EFA than EC2 says the type has: blocked here, not at
    # the launch (EC2 refuses the interfaces)
    from spotctl.providers.aws import efa

    monkeypatch.setitem(efa.EFA, "g5.xlarge", (1, False))
    monkeypatch.setitem(efa.EFA, "p4d.24xlarge", (8, False))
    bad = _by_name(make_provider(instance_types=["g5.xlarge", "p4d.24xlarge"]))["GPU network"]
    assert not bad.ok and bad.blocking, bad  # type: ignore[attr-defined]
    assert "g5.xlarge: EFA x1 asked, EC2 in " in bad.detail  # type: ignore[attr-defined]
    assert "says no EFA" in bad.detail and "p4d.24xlarge: EFA x8 asked" in bad.detail  # type: ignore[attr-defined]
    assert "says at most 4" in bad.detail  # type: ignore[attr-defined]
    # fast network off: one plain interface asked, nothing to check against EC2
    off = make_provider(instance_types=["g5.xlarge", "p4d.24xlarge"])
    off.fast_network = False  # what [placement] fast_network = false sets
    assert _by_name(off)["GPU network"].ok  # type: ignore[attr-defined]


def test_unreadable_quota_is_a_warning_and_a_missing_image_blocks(
    make_provider: MakeProvider,
) -> None:
    # moto answers NoSuchResourceException for EC2 quota codes: unknown, not blocking.
    p = make_provider(instance_types=["g5.xlarge"], ami="",
                      ami_ssm_parameter="/spotctl-test/missing")  # fmt: skip
    checks = {c.name: c for c in p.checks()}
    q = checks["spot GPU quota"]
    assert not q.ok and not q.blocking and "unreadable" in q.detail
    img = checks["image (workers)"]
    assert not img.ok and img.blocking and "/spotctl-test/missing" in img.detail


def test_cli_prints_one_line_each_and_exits_nonzero_when_blocked(
    moto_url: str, ami: str, tmp_path: Path
) -> None:
    (tmp_path / "spotctl.toml").write_text(
        f'[aws]\nregion = "{REGION}"\nami = "{ami}"\ninstance_types = ["g5.xlarge"]\n'
    )
    # ssh_cidr unset: the address `up` would fill it with (never a lookup beyond loopback)
    env = dict(os.environ, SPOTCTL_HOME=str(tmp_path / "home"), NO_COLOR="1", COLUMNS="200",
               SPOTCTL_CONTROLLER_ADDRESS="192.0.2.7")  # fmt: skip
    run = [sys.executable, "-m", "spotctl.cli.app", "check", "--provider", "aws"]
    ok = subprocess.run(run, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = ok.stdout.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == ["ok", "ok", "warn", "ok", "ok", "ok", "ok", "ok",
                                               "ok", "ok", "ok"]
    assert [ln.split()[1:] for ln in lines if " GPU network " in ln] == [
        ["GPU", "network", "g5.xlarge:", "ENA", "(no", "EFA", "on", "this", "type)"]]
    assert lines[0].split()[1] == "credentials"
    assert lines[-1].split()[:2] == ["ok", "ssh_cidr"]
    assert "this machine's public address 192.0.2.7/32" in lines[-1]
    (tmp_path / "spotctl.toml").write_text(
        f'[aws]\nregion = "{REGION}"\ninstance_types = ["g5.xlarge"]\n'
        'ami_ssm_parameter = "/spotctl-test/missing"\n'
    )
    bad = subprocess.run([*run, "--json"], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=120)  # fmt: skip
    assert bad.returncode == 1
    doc = json.loads(bad.stdout)
    assert doc["ok"] is False
    failed = [c["name"] for c in doc["checks"] if not c["ok"] and c["blocking"]]
    assert failed == ["image (workers)", "image (head)"]  # neither SSM parameter exists


def test_quota_is_for_gpus_min_minus_the_spot_vcpus_running(
    make_provider: MakeProvider, quotas: FakeQuotas
) -> None:
    # a region of its own: the spot instances running there are the ones this test starts
    region = "eu-north-1"
    ec2 = boto3.client("ec2", region_name=region)
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    p = make_provider(region=region, ami=ami, instance_types=["g5.xlarge", "g5.12xlarge"],
                      options={"service_quotas_endpoint_url": quotas.url})  # fmt: skip
    p.ctx.spec.gpus = "8..16"
    quotas.values["L-3819A6DF"] = 36.0
    q = _by_name(p)["spot GPU quota"]
    # 8 GPUs: 8 x g5.xlarge (32 vCPUs) beat 2 x g5.12xlarge (96); 36 is enough for one
    # instance and for 8, so far
    assert q.ok, q.detail
    assert "36 vCPUs, 0 in use, gpus.min 8 needs 32 (8 x g5.xlarge)" in q.detail
    ec2.run_instances(ImageId=ami, InstanceType="g5.xlarge", MinCount=2, MaxCount=2,
                      InstanceMarketOptions={"MarketType": "spot"})  # fmt: skip
    ec2.run_instances(ImageId=ami, InstanceType="g5.xlarge", MinCount=1, MaxCount=1)  # on-demand
    q = _by_name(p)["spot GPU quota"]
    assert not q.ok and q.blocking
    assert "36 vCPUs, 8 in use, gpus.min 8 needs 32 (8 x g5.xlarge)" in q.detail
    assert "Service Quotas console" in q.detail


def test_a_new_account_gets_every_missing_precondition_at_once(
    make_provider: MakeProvider, quotas: FakeQuotas, fault_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """PendingVerification on launches, spot quota 0, the storage extra missing: each its
    own failed line with its fix, in one run."""
    from spotctl.control.check import blocking_failures, check_account

    fault_proxy.rules.append(Rule("RunInstances", "PendingVerification", status=400))
    monkeypatch.setitem(sys.modules, "s3fs", None)  # not installed
    p = make_provider(instance_types=["g5.xlarge"], ssh_cidr="",
                      options={"service_quotas_endpoint_url": quotas.url,
                               "endpoint_url": fault_proxy.url})  # fmt: skip
    checks = check_account("aws", p.ctx.spec, dict(p.ctx.options),
                           lookup=lambda: ("192.0.2.7", "a test"))  # fmt: skip
    failed = {c.name: c.detail for c in blocking_failures(checks)}
    assert list(failed) == ["spot GPU quota", "launch (dry run)", "storage extra"]
    assert "ask for more in the Service Quotas console" in failed["spot GPU quota"]
    assert failed["launch (dry run)"].startswith(
        "AWS is still verifying this new account (PendingVerification)")
    assert "pip install 'spotctl[storage]'" in failed["storage extra"]
    ssh = next(c for c in checks if c.name == "ssh_cidr")
    assert ssh.ok and "192.0.2.7/32" in ssh.detail
    # the dry run was a dry run: nothing launched
    runs = fault_proxy.calls("RunInstances")
    assert runs and all("DryRun=true" in b for b in runs)


def test_a_worker_ami_with_an_old_pytorch_is_noted(
    make_provider: MakeProvider, ec2: Any, ami: str
) -> None:
    """The PyTorch 2.7 DLAMI: its torch is not used, so each node downloads the pinned one.
    The name says no driver, so it is a note, not a stop."""
    src = ec2.describe_images(ImageIds=[ami])["Images"][0]
    name = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.7 (Ubuntu 22.04) 20250602"
    old = ec2.register_image(Name=name, RootDeviceName=src["RootDeviceName"],
                             BlockDeviceMappings=src["BlockDeviceMappings"],
                             Architecture="x86_64")["ImageId"]  # fmt: skip
    img = _by_name(make_provider(instance_types=["g5.xlarge"], ami=old))["image (workers)"]
    assert img.ok, img  # type: ignore[attr-defined]
    assert img.detail == (f"{old} ({name}); its PyTorch 2.7 is older than 2.9: each node "  # type: ignore[attr-defined]
                          "downloads torch==2.13.0 instead (several GB; needs NVIDIA driver "
                          "580 or newer)")


def test_check_dry_runs_exactly_the_request_up_would_send_on_a_p5_spec(
    make_provider: MakeProvider, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One launch request, two uses: `up --dry-run --json` shows the request of the first
    plan's launch, and `check` DryRuns that same request (tags with the cluster's name,
    subnet, 32 EFA interfaces without a public address, placement group, instance profile,
    image). P5 spot vCPUs are read from P5's own quota (L-C4BD4855), not P2-P4's."""
    from typer.testing import CliRunner

    from spotctl.cli.app import app
    from spotctl.providers.aws import efa

    name = "p5check"
    p = make_provider(name=name, instance_types=["p5.48xlarge"], zones=["us-east-1a"])
    p.prepare()  # what a first `up` made: the group, key pair and the workers' profile
    p._placement_group("us-east-1a")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "spotctl.toml").write_text(
        f'name = "{name}"\nprovider = "aws"\ngpus = "8..8"\n'
        f'[aws]\nregion = "{REGION}"\nami = "{p.spec.ami}"\ninstance_types = ["p5.48xlarge"]\n'
        'zones = ["us-east-1a"]\nssh_cidr = "198.51.100.7/32"\n')
    up = CliRunner().invoke(app, ["up", "--dry-run", "--json"])
    assert up.exit_code == 0, up.output
    (launch,) = json.loads(up.stdout)["actions"]
    sent = launch["request"]
    checked = CliRunner().invoke(app, ["check", "--provider", "aws", "--json"])
    by = {c["name"]: c for c in json.loads(checked.stdout)["checks"]}
    line = by["launch (dry run)"]
    assert line["ok"], line
    assert line["data"]["request"] == sent
    assert "the first plan's 1 x p5.48xlarge (spot) in us-east-1a would be allowed" in line["detail"]
    # the request is up's own: what the cluster's IAM policy and EC2 look at
    tags = {t["Key"]: t["Value"] for t in sent["TagSpecifications"][0]["Tags"]}
    assert tags["spotctl:cluster"] == name and tags["spotctl:network"] == "efa32"
    nics = sent["NetworkInterfaces"]
    assert len(nics) == 32 and not [n for n in nics if "AssociatePublicIpAddress" in n]
    assert {n["SubnetId"] for n in nics} == {p._subnet("us-east-1a", explicit=True)}
    assert sent["Placement"] == {"AvailabilityZone": "us-east-1a",
                                 "GroupName": f"spotctl-{name}-us-east-1a"}
    assert sent["IamInstanceProfile"] == {"Name": f"spotctl-{name}-node"}
    assert sent["ImageId"] == p.spec.ami and sent["KeyName"] == f"spotctl-{name}"
    assert sent["InstanceMarketOptions"]["MarketType"] == "spot"
    # P5's own spot quota (moto has no EC2 quotas: read, unreadable, by that code)
    q = by["spot GPU quota"]
    assert "L-C4BD4855" in q["detail"] and "L-7212CCBC" not in q["detail"], q
    # the request main sent (a public address with 32 interfaces): check now sees EC2's no
    real = efa.network_interfaces

    def old_layout(*args: Any, **kw: Any) -> list[dict[str, Any]]:
        out = real(*args, **kw)
        out[0]["AssociatePublicIpAddress"] = True
        return out

    monkeypatch.setattr(efa, "network_interfaces", old_layout)
    bad = CliRunner().invoke(app, ["check", "--provider", "aws", "--json"])
    line = {c["name"]: c for c in json.loads(bad.stdout)["checks"]}["launch (dry run)"]
    assert not line["ok"] and line["blocking"] and "InvalidParameterCombination" in line["detail"]
    assert p.cleanup() == []
