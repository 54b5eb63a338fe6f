"""The shared test rig (tests/conftest.py) does what it promises."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests import conftest


def test_network_guard_refuses_beyond_loopback_and_fails_the_test() -> None:
    with socket.socket() as s, pytest.raises(conftest.NetworkGuardError, match="192.0.2.1"):
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed
    with pytest.raises(conftest.NetworkGuardError, match="example.invalid"):
        socket.getaddrinfo("example.invalid", 80)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, pytest.raises(OSError):
        u.sendto(b"x", ("198.51.100.1", 53))
    # recorded even when the code under test swallows the error: the autouse fixture
    # fails the test at teardown (cleared here, since this test provokes them on purpose)
    assert len(conftest._violations) == 3, conftest._violations
    conftest._violations.clear()


def test_network_guard_lets_loopback_and_namespaces_through() -> None:
    port = conftest.free_port()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", port))
        srv.listen()
        with socket.create_connection(("localhost", port), timeout=5):
            pass
    for host in ("127.0.0.1", "127.3.4.5", "::1", "10.213.7.2", "localhost", None):
        assert conftest._allowed_host(host), host
    for host in ("10.0.0.1", "8.8.8.8", "2001:db8::1", "metadata.google.internal"):
        assert not conftest._allowed_host(host), host
    assert conftest._violations == []


def test_wait_until_returns_the_value_or_names_what_it_waited_for() -> None:
    seen = iter([0, 0, 7])
    assert conftest.wait_until(lambda: next(seen), 5, "seven", 0.01) == 7
    with pytest.raises(AssertionError, match="waiting for never; last: False"):
        conftest.wait_until(lambda: False, 0.05, "never", 0.01)


@pytest.mark.ssh
def test_sshd_factory_takes_another_port_when_its_pick_was_taken(
        sshd_factory: conftest.SshdFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    if conftest.sshd_missing():
        pytest.skip(conftest.sshd_missing() or "")
    # someone else's sshd grabs the port this factory picks first (seen in CI with
    # pytest-xdist: 'Bind to port ... failed: Address already in use')
    other = sshd_factory.start()
    picks = iter([other.port, conftest.free_port()])
    monkeypatch.setattr(conftest, "free_port", lambda: next(picks))
    mine = sshd_factory.start()
    assert mine.port != other.port and mine.proc.poll() is None
    with pytest.raises(conftest.PortTaken):  # a port asked for is not replaced
        sshd_factory.start(port=other.port)


def test_head_takes_other_ports_when_its_pick_was_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the head's HTTP port is taken between the pick and the head's bind: it exits naming
    # the port, and the fixture starts it again on new ports (the fault: 'Address already
    # in use' from a port another xdist worker took)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = iter([taken.getsockname()[1], conftest.free_port(), conftest.free_port(),
                      conftest.free_port()])
        monkeypatch.setattr(conftest, "free_port", lambda: next(picks))
        h = conftest.Head(tmp_path)
        try:
            assert h.healthy() and f":{taken.getsockname()[1]}" not in h.url
            assert "already in use" in h.log.read_text().lower()  # the first start failed
        finally:
            h.close()


INNER = '''
import subprocess, sys, time
import pytest

@pytest.mark.slow
def test_leaves_a_process(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", str(tmp_path)],
                         start_new_session=True)
    (tmp_path.parent.parent / "pid").write_text(str(p.pid))
    assert False, "fails with its process still running"
'''


def test_a_failed_slow_test_leaves_no_process_behind(tmp_path) -> None:
    """A slow test that fails with a process of its own still running (a cluster it never
    brought down): the rig kills it after the test and says so, so it cannot load the
    rest of the run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "test_inner.py").write_text(INNER)
    base = tmp_path / "base"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest",
                        "--rootdir", str(tmp_path), "-c", os.devnull, "--basetemp", str(base),
                        "-W", "default", str(tmp_path / "test_inner.py")],
                       cwd=Path(conftest.__file__).parents[1], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    pid = int((tmp_path / "pid").read_text())
    assert f"left 1 processes: killed [{pid}]" in r.stdout, r.stdout
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    # a zombie of an exited parent is reaped by init; one still alive is the failure
    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    assert state == "Z", f"process {pid} still running: {state}"


def test_cpu_log_records_each_test_and_the_summary_reads_it(tmp_path) -> None:
    """SPOTCTL_TEST_CPU_LOG: one line per test, a test that computes shows its CPU time and
    one that sleeps its wall time (what else ran meanwhile counts too: no bound on it);
    scripts/test-cpu totals them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(conftest.__file__).parents[1]
    (tmp_path / "test_inner.py").write_text(
        "import time\n"
        "def test_computes():\n    t = time.process_time()\n"
        "    while time.process_time() - t < 1.0: pass\n"
        "def test_waits():\n    time.sleep(1.0)\n")
    log = tmp_path / "cpu.jsonl"
    env = {**os.environ, "SPOTCTL_TEST_CPU_LOG": str(log)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest",
                        "--rootdir", str(tmp_path), "-c", os.devnull,
                        "--basetemp", str(tmp_path / "base"), str(tmp_path / "test_inner.py")],
                       cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {x["test"].split("::")[-1]: x for x in map(json.loads, log.read_text().splitlines())}
    assert set(rows) == {"test_computes", "test_waits"}, rows
    assert rows["test_computes"]["cpu_s"] >= 0.9 and rows["test_waits"]["wall_s"] >= 1.0, rows
    s = subprocess.run([sys.executable, str(root / "scripts" / "test-cpu"), str(log)],
                       capture_output=True, text=True, timeout=60)
    assert s.returncode == 0 and s.stdout.startswith("2 tests, "), s.stdout + s.stderr
    bad = subprocess.run([sys.executable, str(root / "scripts" / "test-cpu"),
                          str(tmp_path / "none.jsonl")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr


def test_free_port_is_below_the_ephemeral_range_in_this_workers_slice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if conftest._ephemeral_low() < conftest.SPARE_LOW:
        pytest.skip("this kernel's ephemeral range starts too low for the slices")
    # ten slices, all below where spotctl's own processes pick ports (spare_port)
    assert conftest.PORT_BASE + 10 * conftest.PORT_SLICE <= conftest.SPARE_LOW
    for worker, lo in (("gw0", 5000), ("gw3", 8000), ("", 5000)):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        picks = [conftest.free_port() for _ in range(60)]
        assert all(lo <= p < lo + conftest.PORT_SLICE for p in picks), (worker, picks)
        # none handed out twice while the first may not be bound yet (60 random picks of
        # 1000 repeat one 83 % of the time)
        assert len(set(picks)) == len(picks), picks
    # a port someone holds is never handed out
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw5")
    held = []
    try:
        for p in range(10000, 10000 + conftest.PORT_SLICE - 1):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                s.close()
                continue
            held.append(s)
        free = conftest.free_port()  # at most one left in the slice, or none: bind(0)
        assert free not in {s.getsockname()[1] for s in held}
        with socket.socket() as s:
            s.bind(("127.0.0.1", free))
    finally:
        for s in held:
            s.close()
