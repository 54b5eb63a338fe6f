"""SIGTERM to the node agent (spotctl.agent.supervisor.Agent.terminate): on GCP a Spot
VM's preemption is an ACPI soft-off, so systemd stops the agent's unit at the very moment
the notice comes, 30 s before the VM goes. The agent must not throw the graceful leave
away then: with a notice it goes on until its node has left (or shortly before the
notice's deadline); without one it stops, as it always did. The whole path, on a local
cluster whose emulated GCP preemption sends that SIGTERM, is
tests/e2e/test_rescale.py::test_notice_join_gcp_kill_cycle_on_torchft (torchft) and
tests/faults/test_fault_matrix.py::test_rescale_cycle_on_the_cluster (torchrun)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spotctl.agent.config import AgentConfig
from spotctl.agent.supervisor import TERM_DEADLINE_MARGIN_S, TERM_NOTICE_WAIT_S, Agent


def _agent(tmp_path: Path, metadata: str) -> Agent:
    tok = tmp_path / "token"
    tok.write_text("t" * 43)
    tok.chmod(0o600)
    cfg = AgentConfig(cluster="c", node_id="n1", head_url="http://127.0.0.1:9",
                      store_host="127.0.0.1", store_port=1, token_file=str(tok),
                      workdir=str(tmp_path / "w"), script=str(tmp_path / "train.py"),
                      metadata=metadata)
    return Agent(cfg)


def _notice(deadline_in: float) -> dict[str, object]:
    now = time.time()
    return {"id": "x", "source": "gcp", "kind": "preemption", "action": "",
            "deadline": now + deadline_in, "received_at": now}


@pytest.mark.parametrize("metadata", ["gcp", "local"])
def test_sigterm_with_a_notice_leaves_first(tmp_path: Path, metadata: str) -> None:
    a = _agent(tmp_path, metadata)
    a.state = "running"
    assert not a._done()
    a.terminate()
    # the soft-off can come a moment before the watcher has the notice: wait for it
    assert not a._done()
    a.notice = _notice(30.0)
    assert not a._done(), "stopped with a notice and the node not yet left"
    a.state = "leaving"
    assert not a._done()
    a.state = "left"
    assert a._done()


def test_sigterm_with_a_notice_stops_before_its_deadline(tmp_path: Path) -> None:
    a = _agent(tmp_path, "gcp")
    a.state = "running"
    a.notice = _notice(TERM_DEADLINE_MARGIN_S - 0.5)
    a.terminate()
    assert a._done()


@pytest.mark.parametrize("metadata", ["gcp", "aws"])
def test_sigterm_without_a_notice_stops(tmp_path: Path, metadata: str) -> None:
    a = _agent(tmp_path, metadata)
    a.state = "running"
    a.terminate()
    if metadata == "gcp":  # not before the notice had its moment to come
        assert not a._done()
        assert a._term_at is not None
        a._term_at -= TERM_NOTICE_WAIT_S + 0.1
    assert a._done()


@pytest.mark.parametrize("metadata", ["aws", "file"])
def test_elsewhere_sigterm_stops_even_with_a_notice(tmp_path: Path, metadata: str) -> None:
    """AWS shuts a VM down at the notice's deadline, and on ssh hosts SIGTERM is spotctl's
    own `down`: the agent stops at once, as it always did."""
    a = _agent(tmp_path, metadata)
    a.state = "running"
    a.notice = _notice(100.0)
    a.terminate()
    assert a._done()


def test_stop_is_at_once(tmp_path: Path) -> None:
    """SIGINT (stop()): a local cluster's `down`, notice or not."""
    a = _agent(tmp_path, "local")
    a.state = "running"
    a.notice = _notice(100.0)
    a.stop()
    assert a._done()
