"""Every documented exit code (docs/operating.md, "Exit codes") comes out of the
real CLI entry point (spotctl.cli.app:main, the console script's target, with its error
mapping) when the CLI runs into the condition that code names: nothing is raised by the
test itself. The provider errors come from the google-cloud-compute client against the
fake Compute REST server answering as the real API does; the bootstrap error from an SSH
connection that is refused on loopback."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotctl.spec import ClusterSpec
from spotctl.state import NodeRow, Store
from tests.conftest import cli_main
from tests.gcp.fake_compute import FakeCompute

OPERATING = (Path(__file__).parents[2] / "docs" / "operating.md").read_text()


def _store(home: Path) -> Store:
    return Store(home)


def _cluster(home: Path, name: str, provider: str, state: str = "running",
             **section: Any) -> None:
    spec: dict[str, Any] = {"name": name, "provider": provider}
    if section:
        spec[provider] = section
    s = _store(home)
    s.upsert_cluster(name, provider, ClusterSpec.model_validate(spec).model_dump(mode="json"),
                     state)
    s.close()


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code, _, err = cli_main(capsys, *args)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err  # one line, whatever code
    return code, lines[0]


# -- 2, 3, 4: input and local state ----------------------------------------------------------


def test_2_bad_input(spotctl_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run(capsys, "prices", "--provider", "azure")
    assert code == 2 and "azure" in line


def test_3_no_such_cluster(spotctl_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _cluster(spotctl_home, "real", "local")
    code, line = run(capsys, "rebalance", "--name", "nosuch")
    assert code == 3 and "nosuch" in line


def test_4_unusable_state_database(spotctl_home: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    spotctl_home.mkdir(mode=0o700)
    (spotctl_home / "state.db").write_bytes(b"this is not a database\n" * 100)
    code, line = run(capsys, "list")
    assert code == 4 and "state database" in line and "unusable" in line


def test_the_process_itself_exits_with_the_code(spotctl_home: Path, tmp_path: Path) -> None:
    """The same, as a separate process running the CLI module (what the console script
    runs): its exit status, not only main()'s SystemExit."""
    spotctl_home.mkdir(mode=0o700)
    (spotctl_home / "state.db").write_bytes(b"this is not a database\n" * 100)
    repo = Path(__file__).parents[2]
    r = subprocess.run([sys.executable, "-m", "spotctl.cli.app", "list"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 4, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: state database") and r.stderr.count("\n") == 1


def test_4_a_cluster_that_is_down(spotctl_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _cluster(spotctl_home, "gone", "local", state="down")
    code, line = run(capsys, "rebalance", "--name", "gone")
    assert code == 4 and "is down" in line


# -- 5, 6, 7: what a provider's API answers ----------------------------------------------------


@pytest.fixture
def gcp(spotctl_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCompute]:
    """A gcp cluster in the journal, its provider pointed at the fake Compute API."""
    with FakeCompute() as fake:
        monkeypatch.setenv("SPOTCTL_GCP_ENDPOINT", fake.endpoint)
        _cluster(spotctl_home, "g", "gcp", project="test-proj", region="us-central1",
                 zones=["us-central1-a"], ssh_cidr="203.0.113.7/32")
        yield fake


def test_the_gcp_seam_answers_when_nothing_fails(gcp: FakeCompute,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli_main(capsys, "rebalance", "--name", "g", "--dry-run", "--json")
    assert code == 0, err
    assert gcp.calls("instances.aggregatedList")  # the listing below really reached the API


@pytest.mark.parametrize("status,reason,message,want,words", [
    (400, "badRequest", "Invalid value for field 'filter'", 5, "Invalid value"),
    (400, "badRequest", "ZONE_RESOURCE_POOL_EXHAUSTED in us-central1-a", 5,
     "ZONE_RESOURCE_POOL_EXHAUSTED"),
    (403, "quotaExceeded", "Quota 'INSTANCES' exceeded.  Limit: 0.0", 6, "quota exceeded"),
    (403, "forbidden", "Required 'compute.instances.list' permission", 7, "permission denied"),
    (401, "authError", "Request had invalid authentication credentials", 7,
     "not authenticated"),
])
def test_5_6_7_provider_errors(gcp: FakeCompute, capsys: pytest.CaptureFixture[str],
                               status: int, reason: str, message: str, want: int,
                               words: str) -> None:
    gcp.fail("instances.aggregatedList", status, reason, times=99, message=message)
    code, line = run(capsys, "rebalance", "--name", "g", "--dry-run")
    assert code == want, line
    assert words in line and line.startswith("error: gcp: list instances"), line


# -- 8: a host that cannot be reached over SSH -------------------------------------------------


def test_8_host_that_cannot_be_reached(spotctl_home: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    # a port bound and held but never listening: connections to it are refused
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        _cluster(spotctl_home, "s", "ssh",
                 hosts=[{"address": "127.0.0.1", "port": port, "user": "nobody"}])
        s = _store(spotctl_home)
        s.upsert_node(NodeRow(
            id="h1", cluster="s", provider="ssh", zone="127.0.0.1", instance_type="ssh",
            gpus=1, state="running", price=0.0, on_demand_price=0.0, launched_at=1.0,
            ended_at=None, request_id="r", address="127.0.0.1",
            meta={"port": port, "user": "nobody"}))
        s.close()
        code, line = run(capsys, "logs", "h1", "--name", "s")
    assert code == 8, line
    assert "h1" in line and "ssh unreachable" in line


def test_the_codes_tested_here_are_the_documented_list() -> None:
    """Each documented code from 2 to 8 has a test above (1 is "other": anything else)."""
    m = re.search(r"an exit code that says its kind:(.*?)\.\n", OPERATING, re.S)
    assert m, "docs/operating.md: the exit-code sentence is gone"
    listed = {int(c) for c in re.findall(r"(\d) [a-z]", m.group(1))}
    assert listed - {1} == {2, 3, 4, 5, 6, 7, 8}, listed
