"""The torchtitan adapter: spotctl's worker environment -> --fault_tolerance.* arguments.

The environment is the one spotctl.agent.supervisor.start_torchrun gives a torchft-engine
worker (TORCHFT_LIGHTHOUSE, SPOTCTL_FT_REPLICA_INDEX = the replica's dense index, else a
head older than it: SPOTCTL_FT_REPLICA_ID = the group id g<N>; SPOTCTL_MAX_WORLD) plus
torchrun's WORLD_SIZE; tests/e2e/test_rescale.py applies it to real workers' environments
through a notice and a replacement. torchtitan's own parser checks the arguments where
torchtitan is installed (the `torchtitan` extra; CI does not install it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from spotctl.integrations.torchtitan import AdapterError, fault_tolerance_args

ENV = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510", "WORLD_SIZE": "2",
       "SPOTCTL_MAX_WORLD": "8", "SPOTCTL_FT_REPLICA_ID": "g3"}


def test_maps_spotctl_group_to_torchtitan_replica() -> None:
    assert fault_tolerance_args(ENV) == [
        "--fault_tolerance.enable", "--fault_tolerance.replica_id=3",
        "--fault_tolerance.group_size=4"]
    # a one-node replica group on 1 GPU per node, 16 nodes at most
    assert fault_tolerance_args({**ENV, "WORLD_SIZE": "1", "SPOTCTL_MAX_WORLD": "16",
                                 "SPOTCTL_FT_REPLICA_INDEX": "15"})[1:] == [
        "--fault_tolerance.replica_id=15", "--fault_tolerance.group_size=16"]


@pytest.mark.parametrize(("change", "says"), [
    ({"TORCHFT_LIGHTHOUSE": ""}, "TORCHFT_LIGHTHOUSE is not set"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"SPOTCTL_MAX_WORLD": "0"}, "SPOTCTL_MAX_WORLD=0 must be at least 1"),
    ({"SPOTCTL_MAX_WORLD": "7"}, "not a multiple of this replica group's WORLD_SIZE=2"),
    ({"SPOTCTL_FT_REPLICA_ID": "g4"}, "no replica index in [0, 4)"),       # beyond group_size
    ({"SPOTCTL_FT_REPLICA_ID": "node-a1b2"}, "no replica index in [0, 4)"),
    ({"SPOTCTL_FT_REPLICA_INDEX": "-1"}, "SPOTCTL_FT_REPLICA_INDEX='-1'"),
])
def test_refuses_what_would_share_an_identity(change: dict[str, str], says: str) -> None:
    with pytest.raises(AdapterError) as e:
        fault_tolerance_args({**ENV, **change})
    assert says in str(e.value) and "\n" not in str(e.value)


def test_command_line_prints_args_or_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTCTL_", "TORCHFT_"))}
    run = [sys.executable, "-m", "spotctl.integrations.torchtitan"]
    ok = subprocess.run(run, env={**env, **ENV}, capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout.split()) == (0, fault_tolerance_args(ENV))
    bad = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("spotctl: TORCHFT_LIGHTHOUSE is not set")
    assert bad.stderr.count("\n") == 1


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="torchtitan is not installed (the 'torchtitan' extra)")
# torchtitan 0.3.0's models import triton unconditionally, which CUDA builds of torch bring
# and the CPU build does not: with torch 2.13.0+cpu, torchtitan 0.3.0 and triton 3.7.0 this
# passed (2026-12-07); without triton the config registry cannot be imported
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (torchtitan's models import it)")
def test_torchtitan_own_parser_takes_the_args() -> None:
    from torchtitan.config.manager import ConfigManager

    cfg = ConfigManager().parse_args(["--module", "torchft.llama3", "--config",
                                      "llama3_torchft_debugmodel", *fault_tolerance_args(ENV)])
    ft = cfg.fault_tolerance
    assert (ft.enable, ft.replica_id, ft.group_size) == (True, 3, 4)
