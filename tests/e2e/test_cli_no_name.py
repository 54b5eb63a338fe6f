"""Issue 15: the CLI as a new user types it. `init`, `up`, then plain `status --once`,
`events`, `logs`, `report --plot` and `down`, with no --name anywhere (`init` names the
cluster after its folder and keeps the folder's train.py) (the cluster comes
from ./spotctl.toml, then from being the only one), on a real local cluster, on the engine
a plain `init` writes (torchft), whose head replaces a preempted node by itself
([rebalance] on_head), on the network of its own a local cluster gets where this machine
allows it (so what this test reads from the head itself, it reads from inside that
network, as `spotctl` does). `init --engine torchrun` and the torchrun engine's CLI
cycle: tests/unit (init) and tests/e2e/test_rescale.py. Then (issue 62) the same name from
another folder with another script is refused at `up` in one line, and `down --purge`
deletes the local checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from spotctl.agent import proctree
from spotctl.head.auth import node_token
from tests.conftest import SPOTCTL, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]

# the head's /api/status with a token, asked from inside the cluster's network (a
# spotctl command joins it; this test's process does not): its JSON, or the error
ASK_HEAD = """
import json, sys
from pathlib import Path
from spotctl.head.client import HeadClient, HeadUnavailable
from spotctl.providers.local import private
private.JOIN = True
private.join(Path(sys.argv[1]))
try:
    print(json.dumps(HeadClient(sys.argv[2], sys.argv[3]).status()))
except HeadUnavailable as e:
    print(e)
"""


def _ask_head(c: Any, url: str, token: str) -> str:
    r = subprocess.run([sys.executable, "-c", ASK_HEAD, str(c.cluster_dir), url, token],
                       env=c.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


def test_init_up_status_events_logs_report_down_without_name(local_cluster: Any) -> None:
    c = local_cluster("project")  # `init` names it after its folder; the harness tears it down
    (c.project / "spotctl.toml").unlink(missing_ok=True)
    kept = (c.project / "train.py").read_text()
    init = c.cli("init", ".").stdout  # the default engine, as a new user gets it
    assert init.splitlines() == ["wrote spotctl.toml (cluster project)",
                                 "kept train.py: spotctl.toml runs it ([train] script)"], init
    assert (c.project / "train.py").read_text() == kept  # the folder's script, untouched
    spec = (c.project / "spotctl.toml").read_text()
    assert 'name = "project"' in spec and 'engine = "torchft"' in spec
    assert "\nprivate_network" not in spec  # unset: private where this machine allows it
    # status through the CLI, which joins that network (this process reaches no head
    # there); the events stay read from the journal here (no head needed)
    c.status = lambda: json.loads(c.cli("status", "--json").stdout)  # type: ignore[method-assign]

    up = c.cli("up", "--gpus", "1..2", "--wait", "150")
    assert "cluster project: 2 node(s) launched, 2/2 reporting, training" in up.stdout
    assert "the head replaces lost nodes itself ([rebalance] on_head)" in up.stdout
    # the phases, one plain line each on a pipe: per offer, per node, first step
    assert "up: launching 2 x local in local-a" in up.stderr, up.stderr
    assert "up: booting" in up.stderr or "up: joining" in up.stderr, up.stderr
    assert "up: training: step " in up.stderr, up.stderr
    # on a network of its own, or `up` said why not
    private_net = (c.cluster_dir / "private-net.json").exists()
    assert ("note: every user of this machine can reach" in up.stdout) is not private_net

    st = c.cli("status", "--once").stdout
    assert "cluster project" in st and "n1" in st and "n2" in st and "running" in st

    def status() -> dict[str, Any]:
        return json.loads(c.cli("status", "--json").stdout)

    # what each node's agent found on its network (issue 33): a local node is a process
    # tree on this machine, so this machine's interfaces; CPU workers talk over gloo
    nodes = status()["nodes"]
    assert len(nodes) == 2 and all(
        n["net"] is not None and isinstance(n["net"]["interfaces"], list) and n["net"]["efa"] == 0
        and n["nccl_transport"] == "gloo" for n in nodes), nodes

    # the head runs the reconcile loop ([rebalance] on_head, on by default) as its own
    # child, so the loop lives and dies with it; only the controller may read what it did
    head = json.loads((c.cluster_dir / "head" / "head.json").read_text())
    secret = (c.cluster_dir / "token").read_text().strip()
    loop_pid = json.loads(_ask_head(c, head["url"], secret))["rebalancer"]["pid"]
    assert proctree.ppid(loop_pid) == head["pid"] and c.status()["rebalancer"]["running"]
    for token, code in (("", 401), (node_token(secret, "n1"), 403)):
        assert f"answered {code} to /api/status" in _ask_head(c, head["url"], token)
    if private_net:  # and nobody outside that network reaches the head at all
        outside = (c.cluster_dir / "private-net.json").exists() and subprocess.run(
            [sys.executable, "-c", ASK_HEAD.replace("private.JOIN = True", ""),
             str(c.cluster_dir), head["url"], secret],
            env=c.env, capture_output=True, text=True, timeout=60).stdout
        # (an error: not the status JSON; another head on this port number out here
        # would refuse the token)
        assert outside and not outside.startswith("{") and "rebalancer" not in outside, outside
    survivor = c.worker_pids(["n1"])

    p = c.cli("preempt", "n2", "--style", "aws", "--in", "6")
    assert "notice sent to n2 (aws): hard stop in 6 s, at " in p.stdout
    deadline = time.monotonic() + 150
    evs: list[dict[str, Any]] = []

    def noticed() -> list[dict[str, Any]]:
        # picked by reason: on torchft the start-up quorum's growth is rescale events too
        return [e for e in evs if e["type"] == "rescale" and e["reason"] == "notice"]

    while time.monotonic() < deadline:  # the waiting polls in-process; the CLI's output is checked below
        evs = c.events()
        if noticed() and c.status()["step"] > 0:
            break
        time.sleep(0.5)
    rescales = noticed()
    assert all(e in json.loads(c.cli("events", "--json").stdout) for e in rescales)
    assert rescales and (rescales[0]["from_world_size"], rescales[0]["to_world_size"]) == (2, 1)
    # n2's own record, not only the head's inference: its worker drained (a graceful leave
    # at a committed step), and the survivor went on from exactly that step
    rep = json.loads((c.cluster_dir / "nodes" / "n2" / "status" / "worker-0.json").read_text())
    assert rep["phase"] == "drained" and rep["drain_step"] == rep["step"] > 0, rep
    assert rescales[0]["resume_step"] == rep["drain_step"], (rescales[0], rep)
    # nothing more from this side: the head's reconcile loop (on by default) launches a
    # replacement, n3, whose own worker then trains in the quorum of two again
    def n3_training() -> bool:
        r = c.worker_report("n3")
        return r is not None and r["phase"] == "train" and r["replicas"] == 2

    wait_until(n3_training, 150, "the head's loop to bring n3 in", 0.5,
               lambda: (c.cluster_dir / "head" / "rebalance.log").read_text()[-2000:])
    c.steps_advance(world=2, by=2, timeout=60)
    # the survivor trained on through the notice and the join (same process); n3's launch
    # is journaled, and the loop's own log has the run that made it
    assert c.worker_pids(["n1"]) == survivor
    assert next(e for e in c.events("launch") if e["node"] == "n3")["reason"]
    runs = [json.loads(x) for x in (c.cluster_dir / "head" / "rebalance.log").read_text()
            .splitlines() if x.startswith("{")]
    assert any("n3" in r.get("launched", []) for r in runs), runs[-5:]
    assert c.status()["rebalancer"]["last_run_age_s"] is not None
    # the report counts as training the intervals between two of the head's samples (every
    # 2 s) in which the step advanced: wait until there is one (a fast start-up can put the
    # whole run before the notice inside one interval)
    from spotctl.head.samples import SAMPLES_FILE, read_samples

    def sampled_training() -> bool:
        s = read_samples(c.cluster_dir / "head" / SAMPLES_FILE)
        return any(int(b.get("step") or 0) > int(a.get("step") or 0) and a.get("world_size")
                   for a, b in zip(s, s[1:], strict=False))

    wait_until(sampled_training, 60, "a sampled interval in which the step advanced", 0.5)

    ev = c.cli("events").stdout
    # torchft goes on from memory (torchrun: from the drain's checkpoint step)
    assert "world 2 -> 1, notice, in memory from step" in ev and "{" not in ev
    assert any(x.split()[1:2] == ["notice"] and "n2" in x for x in ev.splitlines())

    one = c.cli("logs", "n1", "-n", "5").stdout
    assert one.strip()
    every = c.cli("logs", "--all", "-n", "3", "--raw").stdout.splitlines()
    assert {x.split(" | ")[0].strip() for x in every} == {"n1", "n2", "n3"}
    # without --raw, torch's harmless CPU warnings are left out (only rank 0 logs steps:
    # the other nodes' logs may then show nothing)
    shown = c.cli("logs", "--all", "-n", "1000").stdout
    assert "[c10d] The hostname of the client socket" not in shown and "n1 | " in shown

    png = c.tmp / "run.png"
    rep = json.loads(c.cli("report", "--plot", str(png), "--json").stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    t = rep["totals"]
    assert t["steps"] > 0 and t["pauses"] >= 1 and t["notices"] == 1, t
    assert t["hard_losses"] == 0, rep["marks"]
    assert t["gpu_hours_offered"] > t["gpu_hours_training"] > 0
    assert rep["samples"], "the head sampled nothing"
    evs = json.loads(c.cli("events", "--json").stdout)

    def rel(typ: str) -> list[float]:
        return [round(e["ts"] - rep["start"], 3) for e in evs if e["type"] == typ]

    drawn = rep["plot"]["marks"]
    assert drawn["notice"] == rel("notice") and len(drawn["notice"]) == 1
    assert drawn["rescale"] == rel("rescale")
    assert drawn["join"] == rel("join")
    text = c.cli("report").stdout
    assert "goodput" in text and "lost steps" in text

    ckpts = c.cluster_dir / "checkpoints"
    assert list(ckpts.glob("step-*/COMMIT")), "the run committed no checkpoint"
    assert c.cli("down", "--yes").stdout.strip() == (
        f"cluster project is down; checkpoints kept in {ckpts} (`spotctl down --purge` "
        "deletes them)")
    # down stops the loop with everything else
    wait_until(lambda: c.processes() == [], 30, "no process of the cluster left", 0.2,
               lambda: str(c.processes()))
    assert not proctree.alive(loop_pid), "the reconcile loop outlived `down`"
    # a finished run still reports; with no ./spotctl.toml the only cluster is the one
    (c.project / "spotctl.toml").unlink()
    done = json.loads(c.cli("report", "--json").stdout)
    assert done["state"] == "down" and done["end"] >= rep["end"]
    assert "project" in c.cli("list").stdout

    # the same name in another folder, another script (issue 62): `up` refuses to start it
    # on this job's checkpoints, in one line, before anything starts
    other = c.tmp / "elsewhere"
    other.mkdir()
    (other / "train.py").write_text(kept)
    (other / "spotctl.toml").write_text('name = "project"\nprovider = "local"\ngpus = "1"\n')
    r = subprocess.run([*SPOTCTL, "up"], cwd=other, env=c.env, capture_output=True,
                       text=True, timeout=120)
    step = max(int(d.parent.name.split("-")[1]) for d in ckpts.glob("step-*/COMMIT"))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: cluster project has checkpoints (step {step}) in {ckpts} from another job "
        f"({c.project.resolve() / 'train.py'}), not this one's {other.resolve() / 'train.py'}: `spotctl down "
        "--purge --name project` deletes them, or give this project a name of its own "
        "(`name` in spotctl.toml)"], (r.returncode, r.stderr)
    assert c.processes() == [] and json.loads(c.cli("status", "--json").stdout)["state"] == "down"
    # `down --purge` deletes them (a local cluster's own folder of them), and says so
    n_files = sum(1 for f in ckpts.rglob("*") if f.is_file())
    purged = c.cli("down", "--yes", "--purge").stdout.strip()
    assert purged == (f"cluster project is down; checkpoints deleted: {n_files} file(s) in "
                      f"{ckpts}"), purged
    assert not ckpts.exists()
