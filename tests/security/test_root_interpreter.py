"""The root agent never runs an interpreter the workers' user can change.

The agent runs as root from the node's python so that it can run its training workers as
`[train] run_as`. If that user could write anything the interpreter loads (its site
directories, a `.pth` file, a module, a directory above them), a training script could run
code as root the next time the agent starts. The bootstrap asks, as that user, what it can
write; where it can write anything, the workers run as the login user instead (as for any
other reason they cannot be switched) and `up` says so with the path.

Each case is a venv of this machine's Python that reaches spotctl and torch through the
project's environment, with one thing made writable as an image or a careless `chmod` can
leave it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotctl.remote.bootstrap import worker_fallback_note
from tests.security.conftest import as_user, bootstrap_worker, render_node

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching the workers' user needs a root agent (as on a cloud VM)")

WORKER_USER = "nobody"


def _older_python() -> str:
    """pyenv's 3.10: a venv's prefix is then set by site itself (3.11 sets it at start)."""
    root = os.environ.get("PYENV_ROOT", "/root/.pyenv")
    found = sorted(glob.glob(os.path.join(root, "versions", "3.10.*", "bin", "python3")))
    if not found:
        pytest.skip("no Python 3.10 under pyenv on this machine")
    return found[-1]


@pytest.fixture
def env(request: pytest.FixtureRequest, interpreter_reachable: None) -> Iterator[Path]:
    """envdir/env: a venv (no pip) whose site-packages holds `_project.pth`, which adds the
    project's environment and envdir/extra as site directories. Made from this python, or
    from Python 3.10 where a test asks for "3.10"."""
    base_py = (_older_python() if getattr(request, "param", None) == "3.10"
               else getattr(sys, "_base_executable", sys.executable))
    top = Path(tempfile.mkdtemp(prefix="spotctl-py-"))
    os.chmod(top, 0o755)
    try:
        subprocess.run([base_py, "-m", "venv",
                        "--without-pip", str(top / "env")], check=True, timeout=120)
        (top / "extra").mkdir(mode=0o755)
        site = Path(subprocess.run(
            [str(top / "env" / "bin" / "python"), "-c",
             "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True).stdout.strip())
        (site / "_project.pth").write_text(
            f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r}); "
            f"site.addsitedir({str(top / 'extra')!r})\n")
        os.chmod(site / "_project.pth", 0o644)
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _site(top: Path) -> Path:
    return next((top / "env" / "lib").glob("python3.*")) / "site-packages"


@pytest.mark.parametrize("env", ["this python", "3.10"], indirect=True)
def test_an_interpreter_the_worker_user_cannot_change_runs_its_workers_as_that_user(
    env: Path, base: Path
) -> None:
    # what the prefix holds beyond sys.path is not loaded, and not walked: a Debian
    # python's /usr has links to /dev/null (masked systemd units), which any user can write
    (env / "env" / "share").mkdir()
    (env / "env" / "share" / "masked.service").symlink_to("/dev/null")
    node = render_node(base, WORKER_USER, python=str(env / "env" / "bin" / "python"))
    worker, out = bootstrap_worker(node)
    assert worker == WORKER_USER, out
    assert worker_fallback_note(out) == ""


@pytest.mark.parametrize("what", ["site directory", "pth file", "directory above"])
def test_anything_the_worker_user_can_write_in_the_interpreter_keeps_it_off_root(
    env: Path, base: Path, what: str
) -> None:
    py = env / "env" / "bin" / "python"
    if what == "site directory":
        writable = env / "extra"
        os.chmod(writable, 0o777)
        # what that gives a training script: a .pth that root's next python start runs
        marker = env / "ran-as"
        evil = writable / "zz_evil.pth"
        payload = f"import os; open({str(marker)!r}, 'w').write(str(os.getuid()))\n"
        r = as_user(WORKER_USER, str(py), "-c", f"open({str(evil)!r}, 'w').write({payload!r})")
        assert r.returncode == 0, r.stderr
        subprocess.run([str(py), "-c", "pass"], check=True, timeout=60)
        assert marker.read_text() == "0"
        evil.unlink()
        marker.unlink()
    elif what == "pth file":
        writable = _site(env) / "_project.pth"
        os.chmod(writable, 0o666)
    else:
        writable = env
        os.chmod(env, 0o777)
    node = render_node(base, WORKER_USER, python=str(py))
    worker, out = bootstrap_worker(node)
    assert worker == "none", out
    _says_so(out, writable)


def _says_so(out: str, writable: Path) -> None:
    line = (f"spotctl: workers run as root: {WORKER_USER} can write {writable}, which the "
            "root agent's python loads")
    assert line in out.splitlines(), out
    # and `up` says so, with the path
    note = worker_fallback_note(out)
    assert note.startswith("training workers run as root, not [train] run_as") and \
        str(writable) in note, note


@pytest.mark.parametrize("env", ["this python", "3.10"], indirect=True)
def test_a_planted_pth_cannot_tell_the_check_that_all_is_well(env: Path, base: Path) -> None:
    """The check itself runs that interpreter as the workers' user. A .pth that user planted
    in a writable site directory (here one that another .pth adds, as images do) would run
    in it and could silence it; the check processes no .pth before it has found its file,
    directory and paths unwritable, so it reports the file and never runs it."""
    py = env / "env" / "bin" / "python"
    writable = env / "extra"
    os.chmod(writable, 0o777)
    ran = writable / "ran"
    payload = (f"import os, sys; open({str(ran)!r}, 'a').write('%d ' % os.getuid()); "
               "sys.stdout = open(os.devnull, 'w')\n")
    evil = writable / "zz_quiet.pth"
    r = as_user(WORKER_USER, str(py), "-c", f"open({str(evil)!r}, 'w').write({payload!r})")
    assert r.returncode == 0, r.stderr
    # it does silence a python start: what an earlier check, run with site's setup, printed
    quiet = as_user(WORKER_USER, str(py), "-c", "print('all is well')")
    assert quiet.returncode == 0 and quiet.stdout == "", quiet
    ran.unlink()
    node = render_node(base, WORKER_USER, python=str(py))
    worker, out = bootstrap_worker(node)
    assert worker == "none", out
    _says_so(out, evil)  # the first writable thing it met: the planted file itself
    # the bootstrap's other start as that user (can it import spotctl and torch?) runs
    # site's setup and so the file, as that user only; root never ran it
    assert "0" not in ran.read_text().split(), ran.read_text()


_AGENT = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from spotctl.agent.config import AgentConfig
from spotctl.agent.supervisor import Agent
base, token = sys.argv[1], sys.argv[2]
cfg = AgentConfig(cluster="c1", node_id="n1", head_url="http://127.0.0.1:1",
                  store_host="127.0.0.1", store_port=1, token_file=token,
                  workdir=os.path.join(base, "work"), script=os.path.join(base, "train.py"),
                  run_as=sys.argv[3])
agent = Agent(cfg)
print("worker=" + (agent.worker.name if agent.worker else "root"))
"""


def test_a_root_agent_asks_too_whoever_started_it(env: Path, base: Path) -> None:
    """An agent started as root other than by the bootstrap (by hand, or after the
    interpreter changed) asks the same question before it switches any worker: where the
    workers' user can write what its own python loads, its workers stay root, and it
    says which path in one line."""
    py = env / "env" / "bin" / "python"
    token = base / "token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, ("node:n1:" + "ab" * 32).encode())
    os.close(fd)
    (base / "train.py").write_text("pass\n")
    os.chmod(base / "train.py", 0o644)

    def start() -> tuple[str, str]:
        r = subprocess.run([str(py), "-c", _AGENT, str(base), str(token), WORKER_USER],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout.strip(), r.stderr

    first = start()
    assert first[0] == f"worker={WORKER_USER}", first[1][-3000:]  # nothing writable: switched
    writable = env / "extra"
    os.chmod(writable, 0o777)
    worker, log = start()
    assert worker == "worker=root", log[-3000:]
    assert (f"run_as={WORKER_USER} can write {writable}, which this root agent's python "
            "loads: training workers run as root instead") in log, log[-3000:]


def test_a_running_root_agent_is_restarted_once_its_workers_cannot_be_switched(
    env: Path, base: Path
) -> None:
    """The bootstrap run again on a node whose agent runs: where the workers' user can now
    write what the root agent's python loads, the agent is started again (a running one
    goes on as it was started), and that agent asks too."""
    from tests.conftest import wait_until

    py = env / "env" / "bin" / "python"
    (base / "train.py").write_text("pass\n")
    os.chmod(base / "train.py", 0o644)
    node = render_node(base, WORKER_USER, python=str(py))

    def ensure() -> str:
        r = subprocess.run(["sh", str(node / "bootstrap.sh"), "ensure"], capture_output=True,
                           text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def agent_says(line: str) -> None:
        wait_until(lambda: line in (node / "agent.log").read_text(), 60, line,
                   0.2, lambda: (node / "agent.log").read_text()[-2000:])

    def pid() -> int:
        return int((node / "agent.pid").read_text())

    try:
        out = ensure()
        assert f"spotctl: workers run as {WORKER_USER}" in out and "agent=started" in out, out
        agent_says(f"training workers run as {WORKER_USER}")
        first = pid()
        out = ensure()
        assert "agent=running" in out and pid() == first, out
        writable = env / "extra"
        os.chmod(writable, 0o777)
        out = ensure()
        assert "spotctl: agent restarted: its workers now run as root" in out, out
        assert "agent=started" in out and pid() != first, out
        agent_says(f"run_as={WORKER_USER} can write {writable}")
    finally:
        subprocess.run(["sh", str(node / "bootstrap.sh"), "stop"], capture_output=True,
                       timeout=120, stdin=subprocess.DEVNULL)
