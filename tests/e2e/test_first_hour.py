"""Issue 62, the first hour: what a newcomer does by habit never ends in a silent crash
loop. On one real local cluster (torchft, the engine `init` writes), in a folder of its own
with a script that fails as it starts:

- `init` names the cluster after the folder and keeps the script there;
- Ctrl-C (SIGINT to the real `spotctl up`) says what goes on and how to stop it, exit 130,
  and the cluster does go on starting;
- `up` again, on the running cluster, checks its head (does not "start" it), and exits
  non-zero with the workers' own error line once the node's agent stops restarting them:
  the node's torchrun log (the workers' own record) holds exactly CRASH_LIMIT failures;
- `status` shows the node crashed with that line, `preempt` says there is nothing to
  preempt, `down` says where the checkpoints are.

The README walkthrough (init + up + preempt + down in one folder), the same name reused
with another job's checkpoints and `down --purge`: tests/e2e/test_cli_no_name.py."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from typing import Any

import pytest

from spotctl.agent.crashloop import CRASH_LIMIT
from tests.conftest import SPOTCTL, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

ERROR = "ValueError: dataset_size 2048 is not the 8192 this model was built for"
BROKEN = f"""import time
time.sleep(0.2)
raise ValueError({ERROR.split(": ", 1)[1]!r})
"""


def test_crash_loop_is_an_error_and_ctrl_c_says_what_it_leaves(local_cluster: Any) -> None:
    c = local_cluster("broken-job")
    proj = c.tmp / "broken-job"  # the folder names the cluster
    proj.mkdir()
    (proj / "train.py").write_text(BROKEN)
    init = subprocess.run([*SPOTCTL, "init"], cwd=proj, env=c.env, capture_output=True,
                          text=True, timeout=60)
    assert init.returncode == 0 and init.stdout.splitlines() == [
        "wrote spotctl.toml (cluster broken-job)",
        "kept train.py: spotctl.toml runs it ([train] script)"], init
    assert (proj / "train.py").read_text() == BROKEN
    c.project = proj  # every later `spotctl` runs in that folder, with no --name

    # Ctrl-C while `up` launches: one line on what goes on, exit 130
    up = subprocess.Popen([*SPOTCTL, "up", "--gpus", "1"], cwd=proj, env=c.env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = ""
    assert up.stderr is not None
    while "up: launching" not in err:
        line = up.stderr.readline()
        assert line, f"`up` ended before it launched: {err}"
        err += line
    up.send_signal(signal.SIGINT)
    out, rest = up.communicate(timeout=60)
    assert up.returncode == 130, (up.returncode, err + rest)
    assert ("up: interrupted; cluster broken-job is still starting (its head and the nodes "
            "launched go on); `spotctl down` stops it. Ctrl-C again within 3 s stops it "
            "now") in rest.splitlines(), rest
    assert rest.splitlines()[-1] == (
        "error: interrupted: cluster broken-job is still starting (`spotctl down` stops it)")
    # and it does go on: the node launched before the Ctrl-C reports to the head
    wait_until(lambda: c.worker_report("n1") is not None
               or (c.cluster_dir / "nodes" / "n1" / "torchrun.log").exists(), 120,
               "n1 to start its workers", 0.5, c.debug)

    # `up` again: the head is checked, not started; the crash loop ends it, non-zero, with
    # the workers' own line
    t0 = time.monotonic()
    again = c.cli("up", "--gpus", "1", check=False, timeout=200)
    assert again.returncode == 1, (again.returncode, again.stdout, again.stderr)
    assert "up: checking the head" in again.stderr and "starting the head" not in again.stderr
    assert again.stderr.splitlines()[-1] == (
        f"error: n1: the training script failed repeatedly with the same error, not "
        f"restarted: {ERROR} (`spotctl logs n1`; `spotctl down` stops the "
        "cluster)"), again.stderr
    assert time.monotonic() - t0 < 150  # not the 60 s wait for a step after every start

    # the workers' own record: exactly CRASH_LIMIT failures, none after the agent stopped
    log = c.cluster_dir / "nodes" / "n1" / "torchrun.log"
    assert log.read_text().count(ERROR) == CRASH_LIMIT
    time.sleep(3)
    assert log.read_text().count(ERROR) == CRASH_LIMIT, "torchrun started again"

    st = c.cli("status").stdout.splitlines()
    row = next(x for x in st if x.split()[:1] == ["n1"])
    assert "crashed" in row.split() and f"n1 error: {ERROR}" in st, st
    js = json.loads(c.cli("status", "--json").stdout)
    assert [(n["id"], n["state"], n["error"]) for n in js["nodes"]] == [("n1", "crashed", ERROR)]
    assert any(e["type"] == "crashed" and e["node"] == "n1" and e["error"] == ERROR
               for e in c.events())

    p = c.cli("preempt", "n1", check=False)
    assert p.returncode == 1 and p.stderr.strip() == (
        f"error: n1's workers crashed ({ERROR}): nothing to preempt"), p.stderr
    q = c.cli("preempt", "n7", check=False)
    assert q.returncode == 3 and q.stderr.strip() == (
        "error: node n7 is not running in cluster broken-job; its nodes now: n1 "
        "(`spotctl status`)"), q.stderr

    down = c.cli("down", "--yes").stdout.strip()
    assert down == (f"cluster broken-job is down; checkpoints kept in "
                    f"{c.cluster_dir / 'checkpoints'} (`spotctl down --purge` deletes them)")
    wait_until(lambda: c.processes() == [], 30, "no process of the cluster left", 0.2,
               lambda: str(c.processes()))
