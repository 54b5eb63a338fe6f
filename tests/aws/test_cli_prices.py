"""`spotctl prices` through typer's CliRunner: live against moto, and from the catalog."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from spotctl.cli import cmd_prices
from spotctl.errors import SpecError
from spotctl.providers.aws import catalog as catalog_aws

pytestmark = pytest.mark.aws


@pytest.fixture
def cli(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An app holding just this command (a callback keeps `prices` a subcommand)."""
    monkeypatch.chdir(tmp_path)  # no spotctl.toml here: defaults plus flags
    monkeypatch.setenv("COLUMNS", "200")  # whatever width the runner's terminal has
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        pass

    cmd_prices.register(app)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["prices", *args])


def test_live_json_rows_from_moto(cli: Any, moto_url: str) -> None:
    res = cli("--provider", "aws", "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert rows
    for row in rows:
        for key in ("instance_type", "zone", "gpus", "spot_price", "on_demand_price"):
            assert key in row
        assert row["zone"].startswith("us-east-1")  # live offers carry zone names
    g5 = [r for r in rows if r["instance_type"] == "g5.xlarge"]
    assert g5 and g5[0]["on_demand_price"] == catalog_aws.on_demand_price("g5.xlarge", "us-east-1")
    assert g5[0]["interruption"] == catalog_aws.band_label(
        catalog_aws.interruption_band("g5.xlarge", "us-east-1")
    )
    per_gpu = [r["price_per_gpu_hour"] for r in rows]
    assert per_gpu == sorted(per_gpu)


def test_live_gpu_and_region_flags(cli: Any, moto_url: str) -> None:
    res = cli("--provider", "aws", "--region", "us-west-2", "--gpu", "T4", "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert rows and {r["gpu_name"] for r in rows} == {"T4"}
    assert {r["region"] for r in rows} == {"us-west-2"}
    assert all(r["instance_type"].startswith("g4dn.") for r in rows)


def test_table_has_the_promised_columns(cli: Any, moto_url: str) -> None:
    res = cli("--provider", "aws", "--gpu", "A10G")
    assert res.exit_code == 0, res.output
    for col in (
        "type",
        "zone",
        "GPUs",
        "GPU",
        "spot $/h",
        "on-demand $/h",
        "$/GPU-h",
        "savings %",
        "interruption",
    ):
        assert col in res.stdout
    assert "g5.xlarge" in res.stdout and "us-east-1a" in res.stdout and "…" not in res.stdout


def test_catalog_flag_needs_no_api(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # An endpoint nobody listens on: any API call would fail.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    res = cli(
        "--provider", "aws", "--catalog", "--region", "us-east-1", "--gpu", "A100-80GB", "--json"
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert rows and {r["instance_type"] for r in rows} == {"p4de.24xlarge"}
    assert all(r["zone"].startswith("use1-az") for r in rows)  # catalog zones are zone IDs
    assert rows[0]["spot_price"] == 5.8394 and rows[0]["interruption"] == "<5%"


def test_bad_provider_is_a_spec_error(cli: Any) -> None:
    res = cli("--provider", "azure")
    assert isinstance(res.exception, SpecError)
    assert "unknown provider 'azure'" in str(res.exception)


def test_up_dry_run_plans_aws_launches_without_launching(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ec2: Any
) -> None:
    from spotctl.cli.app import app

    monkeypatch.chdir(tmp_path)
    name = "awsdry"
    res = CliRunner().invoke(
        app,
        ["up", "--provider", "aws", "--gpus", "8..16", "--name", name, "--dry-run", "--json"],
    )
    assert res.exit_code == 0, res.output
    actions = json.loads(res.stdout)["actions"]
    assert actions
    for a in actions:
        assert a["type"] == "launch"
        assert a["zone"].startswith("us-east-1") and a["gpus"] >= 1 and a["count"] >= 1
        assert a["instance_type"] and a["price"] > 0
    assert sum(a["gpus"] * a["count"] for a in actions) >= 8
    flt = [{"Name": "tag:spotctl:cluster", "Values": [name]}]
    assert ec2.describe_instances(Filters=flt)["Reservations"] == []
    assert ec2.describe_security_groups(Filters=flt)["SecurityGroups"] == []
