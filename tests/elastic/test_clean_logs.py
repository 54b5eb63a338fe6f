"""Issue 62: a node's log opens with no warning of spotctl's own making, and `spotctl logs`
leaves out torch's known-harmless CPU warnings (switchable). The lines below are the ones
a local cluster's torchrun.log held (torch 2.13, torchft, gloo)."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._pytree import tree_flatten
from typer.testing import CliRunner

from spotctl.elastic import peerload
from spotctl.elastic.ft import FtRun


def test_a_scheduler_made_before_the_gate_does_not_warn() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # wraps opt.step
    run = SimpleNamespace(_commit=lambda: True)
    opt.step = FtRun._gated(run, opt.step)  # type: ignore[method-assign, arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "optimizer.step() has been overridden ..." before
        opt.step()
        sched.step()
    assert sched.last_epoch == 1


def test_a_peers_pytree_loads_without_a_future_warning() -> None:
    _, spec = tree_flatten({"a": [torch.zeros(1), 2]})
    data = pickle.dumps(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # LeafSpec's deprecation, before
        assert peerload.loads(data) == spec


NOISE = [
    "[W1207 09:14:45.909780717 socket.cpp:207] [c10d] The hostname of the client socket "
    "cannot be retrieved. err=-3",
    "[n2:bd97f237/0 - step 0] Unable to reset NCCL flight recorder recording so traces will "
    "be incorrect.",
    "[rank0]:[W1207 09:14:47.506487505 reducer.cpp:1529] Warning: find_unused_parameters=True "
    "was specified in DDP constructor, but did not find any unused parameters in the forward "
    "pass. This flag results in an extra traversal",
]


@pytest.fixture
def node_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from spotctl.state import NodeRow, Store

    home = tmp_path / "home"
    monkeypatch.setenv("SPOTCTL_HOME", str(home))
    monkeypatch.delenv("SPOTCTL_LOGS_RAW", raising=False)
    monkeypatch.chdir(tmp_path)
    store = Store(home)
    store.upsert_cluster("c", "local", {"name": "c"}, "running")
    store.upsert_node(NodeRow(id="n1", cluster="c", provider="local", zone="z",
                              instance_type="local", gpus=1, state="running", price=0.0,
                              on_demand_price=0.0, launched_at=1.0, ended_at=None,
                              request_id="r", address=""))
    log = store.cluster_dir("c").nodes_dir / "n1" / "torchrun.log"
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(["step 1 loss 0.5", *NOISE, "step 2 loss 0.4"]) + "\n")
    return log


def test_logs_leave_out_torchs_harmless_cpu_warnings(node_log: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from spotctl.cli.app import app

    assert CliRunner().invoke(app, ["logs", "n1"]).output == "step 1 loss 0.5\nstep 2 loss 0.4\n"
    every = CliRunner().invoke(app, ["logs", "--all"]).output.splitlines()
    assert every == ["n1 | step 1 loss 0.5", "n1 | step 2 loss 0.4"]
    assert CliRunner().invoke(app, ["logs", "n1", "--raw"]).output.splitlines()[1:4] == NOISE
    monkeypatch.setenv("SPOTCTL_LOGS_RAW", "1")
    assert len(CliRunner().invoke(app, ["logs", "n1"]).output.splitlines()) == 5
