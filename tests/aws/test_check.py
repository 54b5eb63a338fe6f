"""`spotctl check --provider aws` on moto (+ a Service Quotas fake): one line per check,
non-zero exit when something would stop `up`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spotctl.providers.aws.provider import AwsProvider

from .conftest import REGION
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
    assert list(checks) == ["credentials", "region", "spot GPU quota", "network",
                            "image (workers)", "image (head)", "checkpoint bucket"]  # fmt: skip
    assert checks["checkpoint bucket"].ok
    assert checks["credentials"].ok and "account 123456789012" in checks["credentials"].detail
    assert checks["region"].ok and checks["network"].ok and checks["image (workers)"].ok
    q = checks["spot GPU quota"]
    assert not q.ok and q.blocking
    assert "L-3819A6DF): 0 vCPUs, g5.xlarge needs 4" in q.detail
    assert "L-7212CCBC): 0 vCPUs, p4d.24xlarge needs 96" in q.detail
    assert "\n" not in q.detail
    quotas.values["L-3819A6DF"] = 64.0
    assert {c.name: c for c in p.checks()}["spot GPU quota"].ok


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
    assert [ln.split()[0] for ln in lines] == ["ok", "ok", "warn", "ok", "ok", "ok", "ok", "ok"]
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
