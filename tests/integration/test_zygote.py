"""Warm worker starts: the launcher hands its script to the node's zygote, which forks it
with torch already imported; exit codes, signals, stdio and launcher death behave as if
the script ran in the launcher itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotctl.agent import proctree

pytestmark = pytest.mark.timeout(120)
PY = sys.executable


def _start_zygote(sock: Path, env: dict[str, str] | None = None,
                  timeout: float = 60) -> subprocess.Popen:
    """A zygote on `sock`, once its socket exists (it binds before it imports)."""
    p = subprocess.Popen([PY, "-m", "spotctl.agent.zygote", str(sock)], env=env)
    deadline = time.monotonic() + timeout
    while not sock.exists():
        if time.monotonic() > deadline or p.poll() is not None:
            p.kill()
            p.wait()
            raise AssertionError(f"no zygote socket after {timeout} s")
        time.sleep(0.05)
    return p


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    sock = tmp_path_factory.mktemp("zy") / "z.sock"
    p = _start_zygote(sock)
    yield str(sock)
    p.kill()
    p.wait()


def _script(tmp_path: Path, body: str) -> Path:
    f = tmp_path / "s.py"
    f.write_text("import os, sys, time, signal\n" + body)
    return f


def _launch(script: Path, sock: str, *args: str, **kw):
    env = dict(os.environ, SPOTCTL_ZYGOTE=sock, MARK="from-launcher")
    return subprocess.Popen([PY, "-m", "spotctl.agent.launch", str(script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_forked_worker_gets_argv_env_cwd_stdio_and_exit_code(tmp_path, zygote):
    s = _script(tmp_path, "import torch\nprint(sys.argv[1:], os.environ['MARK'], os.getcwd(),"
                          " 'torch' in sys.modules, os.getppid() != int(sys.argv[1]))\n"
                          "print('err', file=sys.stderr)\nsys.exit(3)\n")
    p = _launch(s, zygote, str(os.getpid()), cwd=tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3
    assert out.strip() == f"[{str(os.getpid())!r}] from-launcher {tmp_path} True True"
    assert "err" in err


def test_a_forked_workers_first_optimizer_imports_nothing_more(tmp_path, zygote):
    """A worker's first optimizer pulls in torch._dynamo (about 200 modules, half a second
    of CPU): the zygote has imported it, so the forked worker's start-up pays nothing for
    it, and the zygote started no thread before forking (the fork would not copy it)."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        pytest.skip("Triton is installed: the zygote leaves torch._dynamo to the worker "
                    "(the next test)")
    s = _script(tmp_path, "import threading, torch\n"
                          "before = set(sys.modules)\n"
                          "opt = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())\n"
                          "print(sorted(set(sys.modules) - before), threading.active_count())\n")
    p = _launch(s, zygote, cwd=tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    # the forked child runs one thread of its own: the watch on its launcher
    assert out.strip() == "[] 2", out


def test_where_triton_is_installed_the_zygote_leaves_torch_dynamo_to_the_worker(tmp_path):
    """torch._dynamo imports Triton, which is not known never to touch the CUDA driver on
    import: a zygote that finds Triton (a stand-in package here, as on CUDA builds) does
    not import torch._dynamo before forking (its workers import it after the fork)."""
    dcp = subprocess.run([PY, "-c", "import sys, torch.distributed.checkpoint; "
                          "print('torch._dynamo' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    if dcp.stdout.strip() == "True":
        pytest.skip("this torch's torch.distributed.checkpoint imports torch._dynamo itself "
                    "(torch 2.7): the zygote cannot leave it to the worker")
    fake = tmp_path / "site"
    (fake / "triton").mkdir(parents=True)
    (fake / "triton" / "__init__.py").write_text("from . import language\n")
    (fake / "triton" / "language.py").write_text("class dtype:\n    pass\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]))
    sock = tmp_path / "z.sock"
    z = _start_zygote(sock, env=env)
    try:
        s = _script(tmp_path, "print('torch' in sys.modules, 'torch._dynamo' in sys.modules,"
                              " 'triton' in sys.modules)\n")
        p = _launch(s, str(sock), cwd=tmp_path)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        # forked warm (torch is there), with neither torch._dynamo nor Triton imported
        assert out.split() == ["True", "False", "False"], (out, err[-2000:])
    finally:
        z.kill()
        z.wait()


def test_a_module_is_forked_warm_as_python_m_runs_it(tmp_path, zygote):
    """`launch -m MODULE ARGS` (the torchft engine's torchrun): the module runs as
    __main__ in a forked child, found from the working directory, with python -m's argv."""
    (tmp_path / "mymod.py").write_text(
        "import os, sys\n"
        "print(__name__, os.path.basename(sys.argv[0]), sys.argv[1:], 'torch' in sys.modules,"
        " os.getppid() != int(sys.argv[1]))\n"
        "sys.exit(5)\n")
    env = dict(os.environ, SPOTCTL_ZYGOTE=zygote)
    p = subprocess.run([PY, "-m", "spotctl.agent.launch", "-m", "mymod", str(os.getpid()), "b"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 5, p.stderr
    assert p.stdout.strip() == f"__main__ mymod.py [{str(os.getpid())!r}, 'b'] True True"
    # the same line cold (no zygote): python -m in the launcher's own process
    del env["SPOTCTL_ZYGOTE"]
    p = subprocess.run([PY, "-m", "spotctl.agent.launch", "-m", "mymod", str(os.getpid()), "b"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 5 and p.stdout.strip() == (
        f"__main__ mymod.py [{str(os.getpid())!r}, 'b'] False False"), p.stderr


def test_a_client_that_sends_nothing_holds_no_launcher_for_long(tmp_path, zygote):
    """A process that connects to the zygote's socket and says nothing is dropped after a
    few seconds; the launcher that asks next still gets its worker forked warm."""
    import socket

    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(zygote)
    try:
        s = _script(tmp_path, "print('torch' in sys.modules, os.getppid() != int(sys.argv[1]))\n")
        p = _launch(s, zygote, str(os.getpid()))
        out, err = p.communicate(timeout=60)
    finally:
        silent.close()
    assert (p.returncode, out.strip()) == (0, "True True"), err


def test_signals_are_forwarded_and_reported(tmp_path, zygote):
    s = _script(tmp_path, "print(os.getpid(), flush=True)\ntime.sleep(60)\n")
    p = _launch(s, zygote)
    child = int(p.stdout.readline())
    assert child != p.pid and proctree.alive(child)
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    assert p.returncode == -signal.SIGTERM  # the launcher dies of the child's signal
    assert not proctree.alive(child)


def test_a_signal_before_the_child_exists_is_forwarded_once_it_does(tmp_path):
    """torchrun's SIGTERM can reach the launcher while the zygote is still forking: the
    launcher holds it and forwards it to the child, then dies of the child's signal. (It
    used to die at once, leaving the child to notice the closed socket some time later.)
    A zygote of the test's own answers only after the signal was sent."""
    import json
    import socket
    import threading

    sock_path = str(tmp_path / "z.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(1)
    victim = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    accepted = threading.Event()
    go = threading.Event()

    def zygote_of_the_test() -> None:
        conn, _ = srv.accept()
        _msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        for fd in fds:
            os.close(fd)
        accepted.set()
        go.wait(30)
        conn.sendall(json.dumps({"pid": victim.pid}).encode() + b"\n")
        victim.wait(30)
        status = -victim.returncode if victim.returncode < 0 else victim.returncode << 8
        conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        conn.close()

    t = threading.Thread(target=zygote_of_the_test, daemon=True)
    t.start()
    try:
        p = _launch(_script(tmp_path, "pass\n"), sock_path)
        assert accepted.wait(30), "the launcher never asked the zygote"
        time.sleep(0.5)  # the launcher now waits for the zygote's answer
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert p.poll() is None, "the launcher died of a signal it should hold"
        go.set()
        p.wait(30)
        victim.wait(30)
        assert victim.returncode == -signal.SIGTERM  # forwarded once the pid was known
        assert p.returncode == -signal.SIGTERM  # then it died of the child's signal
    finally:
        victim.kill()
        srv.close()


def test_child_dies_with_its_launcher(tmp_path, zygote):
    s = _script(tmp_path, "print(os.getpid(), flush=True)\ntime.sleep(60)\n")
    p = _launch(s, zygote)
    child = int(p.stdout.readline())
    p.kill()
    p.wait(10)
    deadline = time.monotonic() + 10
    while proctree.alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not proctree.alive(child)


def test_without_a_zygote_the_script_runs_cold(tmp_path):
    s = _script(tmp_path, "print('cold', 'torch' in sys.modules)\nsys.exit(4)\n")
    p = _launch(s, str(tmp_path / "no.sock"))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 4 and out.strip() == "cold False"


def _orphan_zygote(tmp_path: Path, then: str = "") -> int:
    """Run a short-lived "agent": it starts a real zygote, waits until it serves, runs
    `then` (Python), and exits, leaving the zygote reparented. Returns the zygote's pid."""
    sock, pidfile = tmp_path / "z-orphan.sock", tmp_path / "zygote.pid"
    agent = ("import os, subprocess, sys, time; "
             f"p = subprocess.Popen([sys.executable, '-m', 'spotctl.agent.zygote', {str(sock)!r}]); "
             f"open({str(pidfile)!r}, 'w').write(str(p.pid)); "
             f"t = time.monotonic() + 60\n"
             f"while not os.path.exists({str(sock)!r}) and time.monotonic() < t: time.sleep(0.1)\n"
             + then)
    subprocess.run([PY, "-c", agent], check=True, timeout=90,
                   env=dict(os.environ, SPOTCTL_ZYGOTE=str(sock)))
    assert sock.exists(), "the zygote never served"
    return int(pidfile.read_text())


def _ends(pid: int, deadline: float) -> bool:
    """Whether process `pid` is gone by `deadline` (SIGKILLed if not, for cleanup)."""
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    return False


def test_zygote_ends_when_the_agent_that_started_it_is_gone(tmp_path):
    """A zygote whose agent died (it is reparented) ends by itself: nobody would ask it
    for a worker again, and it holds a warm torch heap (seen left behind by a killed
    local node)."""
    pid = _orphan_zygote(tmp_path)
    assert _ends(pid, time.monotonic() + 90), "the orphaned zygote was still running"


def test_orphaned_zygote_still_reports_its_running_workers_then_ends(tmp_path):
    """A zygote whose agent died while a worker it forked still runs keeps serving that
    worker's launcher (which would otherwise report the worker dead) and ends after."""
    rc = tmp_path / "rc"
    script = _script(tmp_path, "time.sleep(3)\nsys.exit(7)\n")
    launch = f"{PY} -m spotctl.agent.launch {script}; echo $? > {rc}"
    # the worker is forked (its launcher in a session of its own); then the agent is gone
    pid = _orphan_zygote(tmp_path, f"subprocess.Popen(['sh', '-c', {launch!r}], "
                                   "start_new_session=True)\ntime.sleep(1)")
    deadline = time.monotonic() + 60
    while not rc.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rc.read_text().strip() == "7"  # the worker's own exit code, not "zygote died"
    assert _ends(pid, deadline), "the orphaned zygote did not end once its worker had"


def test_a_worker_asked_for_while_the_zygote_imports_waits_and_starts_warm(tmp_path):
    """The agent starts the zygote and torchrun together, so the first launcher can ask
    before torch is imported: the zygote listens before it imports, and the request waits
    for the warm fork instead of starting the worker cold (seen: 2 of 3 torchft workers
    cold at start-up). Here the zygote's `import torch` is held at a gate (a stand-in
    package that imports the real torch once the gate file exists)."""
    fake = tmp_path / "gated"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        "import importlib, os, sys, time\n"
        "while not os.path.exists(os.environ['ZYGOTE_GATE']):\n"
        "    time.sleep(0.02)\n"
        "sys.path.remove(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n"
        "del sys.modules['torch']\n"
        "sys.modules['torch'] = importlib.import_module('torch')\n")
    gate = tmp_path / "gate"
    sock = tmp_path / "z.sock"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(fake), os.environ.get("PYTHONPATH", "")]), ZYGOTE_GATE=str(gate))
    z = _start_zygote(sock, env, timeout=30)  # the socket comes before the (held) imports
    try:
        p = _launch(_script(tmp_path, "print('torch' in sys.modules, flush=True)\n"), str(sock))
        # a cold start would have run the script by now; the launcher waits on the zygote
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(2)
        gate.touch()
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and out.strip() == "True", (out, err)
    finally:
        z.kill()
        z.wait()
