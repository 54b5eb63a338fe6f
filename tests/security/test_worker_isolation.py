"""Training workers never see a credential: with a root agent and `run_as`, torchrun, the
warm zygote and every worker it forks run as an unprivileged user who cannot read the
node token or the cluster secret, while training itself runs (a tiny real run through
the real agent, head, torchrun and zygote)."""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from spotctl.agent.config import AgentConfig
from spotctl.head.auth import node_token
from tests.conftest import SPOTCTL, Head, wait_until
from tests.security.conftest import as_user as _as
from tests.security.conftest import bootstrap_worker as _bootstrap_worker
from tests.security.conftest import render_node as _render_node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="switching the workers' user needs a root agent (as on a cloud VM)"),
]

WORKER_USER = "nobody"

PROBE = r'''
import json, os, sys
from pathlib import Path

import torch
from torch import nn

from spotctl import elastic

def attempt(path):
    try:
        return "READ:" + Path(path).read_text()
    except OSError as e:
        return f"denied errno={e.errno}"

report = {
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "zygote": os.environ.get("SPOTCTL_ZYGOTE", ""), "ppid": os.getppid(),
    "env": dict(os.environ),
    "own_script": attempt(sys.argv[0])[:5],
    "token": attempt(os.environ["PROBE_TOKEN"]),
    "secret": attempt(os.environ["PROBE_SECRET"]),
    "head_secret": attempt(os.environ["PROBE_HEAD_SECRET"]),
    "agent_config": attempt(os.environ["PROBE_CONFIG"]),
}
# what scripts do under ~ (the Hugging Face and torch.hub caches): nobody's own home,
# /nonexistent, is not there
cache = Path.home() / ".cache" / "probe"
try:
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"rank{os.environ.get('RANK')}").write_text("x")
    report["home_cache"] = "WRITTEN"
except OSError as e:
    report["home_cache"] = f"denied errno={e.errno}"
# the worker's parent is the zygote; the zygote's parent is the agent. The zygote's ids
# are read now: it may be gone by the time the test looks (the run ends, it exits)
status = Path(f"/proc/{os.getppid()}/status").read_text()
report["ppid_uids"] = [int(x) for x in status.split("\nUid:", 1)[1].split()[:4]]
agent = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[1])
report["agent_pid"] = agent
for what in ("environ", "mem"):
    try:
        with open(f"/proc/{agent}/{what}", "rb") as f:
            f.read(1)
        report["agent_" + what] = "READ"
    except OSError as e:
        report["agent_" + what] = f"denied errno={e.errno}"
# one file per rank: two ranks' 4 KB lines interleave in a shared log (seen in CI)
(Path.home() / f"probe-{os.environ['RANK']}.json").write_text(json.dumps(report))

model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 4), torch.randn(64, 1)
run = elastic.Run(model, opt, dataset_size=64, global_batch=8, seed=0)
while run.next_step():
    idx = run.batch_indices()
    opt.zero_grad()
    loss = ((run.model(x[idx]) - y[idx]) ** 2).sum()
    (loss * run.loss_scale).backward()
    opt.step()
    run.end_step(loss=loss.item())
run.finish()
'''


def _private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, text.encode())
    os.close(fd)


def test_workers_run_unprivileged_and_cannot_read_credentials(
    base: Path, tmp_path: Path, interpreter_reachable: None
) -> None:
    nobody = pwd.getpwnam(WORKER_USER)
    head = Head(tmp_path)
    agent = None
    try:
        node_id = "n-isolated"
        # The node directory as the bootstrap leaves it: traversable, its secrets 0600.
        node = base / "node"
        node.mkdir(mode=0o711)
        os.chmod(node, 0o711)
        token = node_token(head.token, node_id)
        _private(node / "token", token + "\n")
        # A copy of the cluster secret behind nothing but its 0600 mode (the head's own
        # file is also probed, wherever it is).
        state = base / "state"
        state.mkdir(mode=0o711)
        os.chmod(state, 0o711)
        _private(state / "token", head.token)
        project = base / "project"
        project.mkdir(mode=0o755)
        os.chmod(project, 0o755)
        script = project / "probe_train.py"
        script.write_text(PROBE)
        os.chmod(script, 0o644)
        ckpt = base / "ckpt"
        config = node / "agent.json"
        cfg = AgentConfig(
            cluster="iso", node_id=node_id, head_url=head.url, store_host="127.0.0.1",
            store_port=head.store_port, token_file=str(node / "token"),
            workdir=str(node / "work"), script=str(script), nproc_per_node=2, max_nodes=1,
            checkpoint_dir=str(ckpt), checkpoint_every=2, max_steps=4, run_as=WORKER_USER,
            env={"PROBE_TOKEN": str(node / "token"), "PROBE_SECRET": str(state / "token"),
                 "PROBE_HEAD_SECRET": str(head.token_file), "PROBE_CONFIG": str(config)},
        )  # fmt: skip
        cfg.save(config)
        os.chmod(config, 0o600)
        agent_log = open(tmp_path / "agent.log", "ab")
        agent = subprocess.Popen(
            [*SPOTCTL, "agent", "--config", str(config)], stdout=agent_log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        work = node / "work"

        def logs() -> str:
            out = (tmp_path / "agent.log").read_text()[-3000:]
            p = work / "torchrun.log"
            return out + "\n--- torchrun.log\n" + (p.read_text()[-3000:] if p.exists() else "")

        def finished() -> bool:
            if agent.poll() is not None:
                raise AssertionError(f"agent exited {agent.returncode}: {logs()}")
            n = head.status().get("nodes", {}).get(node_id, {})
            return n.get("state") == "finished"

        wait_until(finished, 240, "the tiny run to finish as the worker user", 0.5, logs)

        reports = [json.loads(p.read_text()) for p in sorted((work / "home").glob("probe-*.json"))]
        assert len(reports) >= 2, logs()  # both local ranks
        for r in reports:
            assert (r["uid"], r["euid"], r["gid"]) == (nobody.pw_uid, nobody.pw_uid,
                                                       nobody.pw_gid), r
            assert 0 not in r["groups"], r
            assert r["own_script"] == "READ:", r  # the probe itself can read what it may
            for what in ("token", "secret", "head_secret", "agent_config"):
                assert r[what].startswith("denied"), (what, r[what])
            assert r["agent_pid"] == agent.pid, r
            assert r["agent_mem"].startswith("denied"), r
            assert r["agent_environ"].startswith("denied"), r
            assert not any(token in v or head.token in v for v in r["env"].values())
            # nobody's home is /nonexistent: the agent gives it one in its workdir
            assert r["env"]["HOME"] == str(work / "home"), r["env"]["HOME"]
            assert r["home_cache"] == "WRITTEN", r
        # forked by the warm zygote (itself running as the worker user), not cold-started
        assert all(r["zygote"] for r in reports)
        for r in reports:  # real, effective, saved and filesystem uid
            assert r["ppid_uids"] == [nobody.pw_uid] * 4, r["ppid_uids"]
        # training ran and committed its checkpoints, written by the worker user
        commits = list(ckpt.rglob("COMMIT"))
        assert commits, sorted(str(p) for p in ckpt.rglob("*"))
        assert all(p.stat().st_uid == nobody.pw_uid for p in commits)
        # the agent's files stay the agent's
        assert (node / "token").stat().st_uid == 0
        assert (work / "torchrun.log").stat().st_uid == 0
    finally:
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        head.close()


def test_bootstrap_sets_up_the_worker_user_and_keeps_the_token_private(
    base: Path, interpreter_reachable: None
) -> None:
    node = _render_node(base, WORKER_USER)
    worker, out = _bootstrap_worker(node)
    assert worker == WORKER_USER, out
    assert f"spotctl: workers run as {WORKER_USER}" in out
    from spotctl.remote.bootstrap import worker_fallback_note

    assert worker_fallback_note(out) == ""
    # the worker user reaches its workdir, and not the token or the agent's config
    assert _as(WORKER_USER, "test", "-x", str(node / "work")).returncode == 0
    for secret in ("token", "agent.json"):
        r = _as(WORKER_USER, "cat", str(node / secret))
        assert r.returncode != 0 and "Permission denied" in r.stderr, (secret, r)
        assert stat.S_IMODE((node / secret).stat().st_mode) == 0o600
    # nor list the node directory (search only)
    assert _as(WORKER_USER, "ls", str(node)).returncode != 0


def test_bootstrap_without_a_usable_interpreter_says_workers_run_as_the_login_user(
    base: Path, interpreter_modes: None
) -> None:
    import spotctl

    blocked = [d for p in (Path(os.path.realpath(sys.executable)), Path(spotctl.__file__))
               for d in p.parents if not d.stat().st_mode & stat.S_IXOTH]
    if not blocked:
        pytest.skip("this interpreter is usable by every user; nothing to fall back from")
    node = _render_node(base, WORKER_USER)
    worker, out = _bootstrap_worker(node)
    assert worker == "none", out
    assert f"{WORKER_USER} cannot run" in out
    # and `up` says so with the node's line, not only the node's log
    from spotctl.remote.bootstrap import worker_fallback_note

    note = worker_fallback_note(out)
    assert note.startswith("training workers run as ") and "not [train] run_as" in note, note
    assert f"{WORKER_USER} cannot run" in note and "node's credential" in note


def test_bootstrap_with_no_run_as_leaves_workers_to_the_login_user(base: Path) -> None:
    node = _render_node(base, "")
    worker, out = _bootstrap_worker(node)
    assert worker == "none" and "workers run as" not in out
    assert stat.S_IMODE(node.stat().st_mode) == 0o700


def test_root_agent_whose_worker_user_cannot_run_python_says_so(
    base: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, interpreter_modes: None
) -> None:
    """An agent started as root by hand, with a run_as user who cannot run its interpreter,
    keeps its workers as root (as without run_as) and logs why, in one line."""
    import spotctl
    from spotctl.agent.supervisor import Agent

    if all(d.stat().st_mode & stat.S_IXOTH
           for p in (Path(os.path.realpath(sys.executable)), Path(spotctl.__file__))
           for d in p.parents):
        pytest.skip("this interpreter is usable by every user")
    _private(tmp_path / "token", "node:n1:" + "ab" * 32)
    cfg = AgentConfig(cluster="c1", node_id="n1", head_url="http://127.0.0.1:1",
                      store_host="127.0.0.1", store_port=1,
                      token_file=str(tmp_path / "token"), workdir=str(base / "work"),
                      script=str(base / "train.py"), run_as=WORKER_USER)
    with caplog.at_level("ERROR", logger="spotctl.agent"):
        agent = Agent(cfg)
    assert agent.worker is None
    assert any(f"run_as={WORKER_USER} cannot use" in r.getMessage() for r in caplog.records)


def test_bootstrap_creates_the_worker_user_when_missing(base: Path) -> None:
    name = "spotctl-t" + os.urandom(3).hex()
    node = _render_node(base, name)
    try:
        _bootstrap_worker(node)
        pw = pwd.getpwnam(name)  # created: a system user without a login shell
        assert 0 < pw.pw_uid < 1000 and pw.pw_shell.endswith("nologin")
        assert _as(name, "cat", str(node / "token")).returncode != 0
    finally:
        subprocess.run(["userdel", name], capture_output=True)
