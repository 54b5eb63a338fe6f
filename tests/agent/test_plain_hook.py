"""Issue 57, the worker's side: the launch path recognises a plain torchrun script at its
init_process_group (never from its source) and the optional calls keep their contract.
Real processes, a real gloo group of one, the real launcher (`--worker`, the cold path the
agent's zygote-less workers take); what is checked is each worker's own status file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotctl.sockets import spare_port

PLAIN = """
import json, os, sys, time
import torch.distributed as dist
from spotctl.elastic import notice, notice_saved, report
dist.init_process_group("gloo")
status = os.path.join(os.environ["SPOTCTL_STATUS_DIR"], "worker-0.json")
first = json.load(open(status))
assert notice() is None                       # no file yet
path = os.environ["SPOTCTL_NOTICE_FILE"]
open(path, "w").write(json.dumps({"reason": "notice", "deadline": time.time() + 30, "id": "x"}))
n = notice()
report(step=3, samples=32, loss=0.5)
time.sleep(1.1)
report(step=4, samples=32, loss=0.25)
after = json.load(open(status))
print(json.dumps({"first": first, "notice": n, "after": after}), flush=True)
notice_saved(4)
print("notice_saved returned", flush=True)
"""

# the group forms twice: by spotctl.elastic (route "elastic": nothing written), then by the
# script itself on the torchft engine (one torchrun per node): reported, and it trains nothing
FT = """
import os, sys
import torch.distributed as dist
import spotctl.elastic as elastic
elastic.init()
assert not os.listdir(os.environ["SPOTCTL_STATUS_DIR"]), "spotctl.elastic's own group"
dist.destroy_process_group()
dist.init_process_group("gloo")
print("TRAINED ALONE", flush=True)
"""


def _worker(tmp: Path, name: str, code: str, **env: str) -> tuple[subprocess.Popen[str], Path]:
    d = tmp / name
    (d / "status").mkdir(parents=True)
    script = d / "train.py"
    script.write_text(code)
    e = dict(os.environ, SPOTCTL_STATUS_DIR=str(d / "status"), SPOTCTL_NOTICE_FILE=str(d / "notice.json"),
             LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
             MASTER_PORT=str(spare_port("127.0.0.1")), **env)
    e.pop("SPOTCTL_ZYGOTE", None)
    p = subprocess.Popen([sys.executable, "-m", "spotctl.agent.launch", str(script)], env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, d / "status" / "worker-0.json"


def _wait_file(p: subprocess.Popen[str], path: Path, pred, timeout: float = 60) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end and p.poll() is None:
        try:
            v = json.loads(path.read_text())
            if pred(v):
                return v
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{path}: never as expected; exit {p.poll()}")


@pytest.mark.slow  # two interpreters importing torch: about 10 s on two busy cores
def test_plain_script_recognised_at_init_and_its_calls(tmp_path: Path) -> None:
    p1, st1 = _worker(tmp_path, "plain", PLAIN)
    p2, st2 = _worker(tmp_path, "ft", FT, SPOTCTL_ENGINE="torchft")
    try:
        # the plain script: route plain, training, one incarnation id (from its store)
        done = _wait_file(p1, st1, lambda v: v["phase"] == "drained")
        assert done["drain_step"] == 4 and done["step"] == 4 and done["route"] == "plain"
        # notice_saved never returns: the worker waits for SIGTERM and dies of it
        time.sleep(0.3)
        assert p1.poll() is None
        p1.send_signal(signal.SIGTERM)
        out, err = p1.communicate(timeout=30)
        assert p1.returncode == -signal.SIGTERM and "returned" not in out, (out, err[-2000:])
        rec = json.loads(out.splitlines()[0])
        first, after = rec["first"], rec["after"]
        assert (first["route"], first["phase"], first["world_size"]) == ("plain", "train", 1)
        assert first["incarnation"] and first["first_step_at"] > 0
        assert rec["notice"]["reason"] == "notice" and rec["notice"]["id"] == "x"
        assert after["step"] == 4 and after["loss"] == 0.25 and after["throughput"] > 0

        # torchft: reported (phase init), and the script never gets past its init
        rep = _wait_file(p2, st2, lambda v: True)
        assert (rep["route"], rep["phase"]) == ("plain", "init")
        time.sleep(0.5)
        assert p2.poll() is None
        p2.send_signal(signal.SIGTERM)
        out, err = p2.communicate(timeout=30)
        assert p2.returncode != 0 and "TRAINED ALONE" not in out, (out, err[-2000:])
        assert "one torchrun job across the nodes" in err
    finally:
        for p in (p1, p2):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_notice_ignores_a_file_from_a_past_round(tmp_path: Path, monkeypatch) -> None:
    """A notice written before this process formed its group (the previous round's) is
    not for it: notice() returns None, without a process group or the agent."""
    from spotctl.elastic import plain

    f = tmp_path / "notice.json"
    f.write_text(json.dumps({"reason": "rescale", "deadline": 1.0, "id": "old"}))
    os.utime(f, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setenv(plain.NOTICE_ENV, str(f))
    monkeypatch.setattr(plain, "_notice_seen", None)
    monkeypatch.setattr(plain, "_formed_at", time.time() - 10)
    assert plain.notice() is None
    f.write_text(json.dumps({"reason": "rescale", "deadline": 2.0, "id": "new"}))
    assert plain.notice() == {"reason": "rescale", "deadline": 2.0, "id": "new"}
