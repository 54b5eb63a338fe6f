"""`[local] private_network` in-process: which heads go private, and how a holder is
recognised (the real namespaces: tests/security/test_local_private_network.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spotctl.errors import SpotctlError
from spotctl.providers.base import ProviderContext
from spotctl.providers.local import private
from spotctl.providers.local.provider import LocalProvider
from spotctl.spec import ClusterSpec
from spotctl.state import Store


def _local(tmp_path: Path, provider: str) -> LocalProvider:
    raw: dict[str, object] = {"name": "c1", "provider": provider,
                              "local": {"private_network": True}}
    if provider == "ssh":
        raw["ssh"] = {"hosts": [{"address": "127.0.0.1"}]}
    spec = ClusterSpec.model_validate(raw)
    return LocalProvider(ProviderContext("c1", spec, Store(tmp_path / "home").cluster_dir("c1")))


def test_an_ssh_clusters_head_stays_on_this_machines_loopback(tmp_path: Path) -> None:
    p = _local(tmp_path, "ssh")
    p.prepare()  # would start (here: refuse to start) a private network if it went private
    assert not (p.cdir.path / private.HOLDER_FILE).exists()


def test_only_the_spotctl_command_starts_a_private_cluster(tmp_path: Path) -> None:
    assert private.JOIN is False  # pytest's process never joins one
    with pytest.raises(SpotctlError, match="started by the spotctl command"):
        _local(tmp_path, "local").prepare()


def test_a_holder_file_naming_a_reused_pid_is_no_holder(tmp_path: Path) -> None:
    f = tmp_path / private.HOLDER_FILE
    me = os.getpid()
    net = os.readlink("/proc/self/ns/net")
    f.write_text(json.dumps({"pid": me, "net": net, "user": "", "started": "1"}))
    assert private.holder(tmp_path) is None  # another start time: not the holder
    f.write_text(json.dumps({"pid": me, "net": net, "user": "",
                             "started": private._start_time(me)}))
    assert private.holder(tmp_path) is not None
    f.write_text("{")
    assert private.holder(tmp_path) is None


def test_unset_in_a_python_program_stays_on_loopback(tmp_path: Path) -> None:
    spec = ClusterSpec.model_validate({"name": "c1", "provider": "local"})
    assert spec.local.private_network is None  # unset: private where this machine allows
    p = LocalProvider(ProviderContext("c1", spec, Store(tmp_path / "home").cluster_dir("c1")))
    p.prepare()  # not the spotctl command: no network of its own, and no error
    assert not (p.cdir.path / private.HOLDER_FILE).exists()


def test_up_says_why_an_unset_cluster_stayed_on_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(private, "JOIN", True)
    (tmp_path / "private-net.log").write_text(
        "spotctl private network: [Errno 1] unshare(user and network namespaces): "
        "Operation not permitted\n")
    note = private.missing_note(tmp_path, "auto")
    assert note == (
        "note: every user of this machine can reach this cluster's listeners ([Errno 1] "
        "unshare(user and network namespaces): Operation not permitted); [local] "
        "private_network = false says that is meant")
    assert private.missing_note(tmp_path, "off") == ""  # asked for: nothing to say
    monkeypatch.setattr(private, "JOIN", False)
    assert private.missing_note(tmp_path, "auto") == ""  # not the spotctl command


@pytest.mark.parametrize("raw,mode", [
    ({}, "auto"),
    ({"local": {"private_network": True}}, "on"),
    ({"local": {"private_network": False}}, "off"),
    ({"local": {"netns": True}}, "off"),  # nodes on a bridge of their own
    ({"provider": "ssh", "ssh": {"hosts": [{"address": "127.0.0.1"}]},
      "local": {"private_network": True}}, "off"),  # the head its hosts reach here
])
def test_what_a_spec_asks_of_the_private_network(raw: dict[str, object], mode: str) -> None:
    assert private.setting(ClusterSpec.model_validate({"name": "c1", **raw})) == mode


def _sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits for `pid` (which blocks it): kill() marks it pending before
    it returns, so this needs no waiting."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) & (1 << (15 - 1)))
    raise AssertionError("no ShdPnd in /proc/PID/status")


def test_stop_signals_the_holder_and_never_a_pid_that_no_longer_is_it(tmp_path: Path) -> None:
    """kills: private.stop() signalling a pid that is no longer the holder (the `alive`
    check of its record dropped). A process of this test (blocking SIGTERM, so that a
    signal stays pending where it can be read) stands in for the holder: with another
    start time in the file (its pid since reused) it is not signalled and the file goes;
    with its own start time and namespace it is the holder and gets SIGTERM."""
    import subprocess
    import sys

    f = tmp_path / private.HOLDER_FILE
    p = subprocess.Popen([sys.executable, "-c",
                          "import signal, sys, time\n"
                          "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
                          "print('ready', flush=True)\ntime.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        net = os.readlink(f"/proc/{p.pid}/ns/net")
        f.write_text(json.dumps({"pid": p.pid, "net": net, "user": "", "started": "1"}))
        private.stop(tmp_path)
        assert not f.exists()
        assert not _sigterm_pending(p.pid)  # not the holder: not signalled
        f.write_text(json.dumps({"pid": p.pid, "net": net, "user": "",
                                 "started": private._start_time(p.pid)}))
        private.stop(tmp_path)
        assert _sigterm_pending(p.pid)  # the holder: signalled
        assert not f.exists()
    finally:
        p.kill()
        p.wait()


def test_a_start_time_is_read_past_a_name_with_parentheses(tmp_path: Path) -> None:
    """kills: private.py `stat.rsplit(")", 1)[1].split()[19]` made `.split(")", 1)`,
    `rsplit(")")`, `rsplit(")", 2)` or `[20]` (mutmut 2026-12-07): a process's name (its
    executable's, here a link named `p) 1 2 (3`) may hold ")" and spaces, and the field
    read is the start time (clock ticks since boot), not the next one (the memory size)."""
    import subprocess
    import sys
    import time

    link = tmp_path / "p) 1 2 (3"
    link.symlink_to(sys.executable)
    t0 = time.time()
    p = subprocess.Popen([str(link), "-c", "import time; time.sleep(60)"])
    try:
        assert ") 1 2 (3)" in Path(f"/proc/{p.pid}/stat").read_text()  # the name as read
        boot = next(float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                    if ln.startswith("btime "))
        ticks = os.sysconf("SC_CLK_TCK")
        started = boot + int(private._start_time(p.pid)) / ticks
        assert t0 - 2 <= started <= time.time() + 2, (started, t0)
    finally:
        p.kill()
        p.wait()


def test_a_dead_holder_is_stood_in_for_by_a_cluster_process_in_its_namespaces(
        tmp_path: Path) -> None:
    """kills: private.py holder()'s stand-in (mutmut 2026-12-07: 25 survivors): a cluster
    process (tagged under the cluster's directory) in the dead holder's network AND user
    namespaces stands in for it, under its own pid; one in another network namespace (a
    real holder's, started first) does not. And `_recorded` says a holder whose pid is gone
    is not alive (`return h, False` made True)."""
    import subprocess
    import sys
    import time

    from spotctl.agent.proctree import TAG_VAR

    gone = subprocess.Popen(["true"])
    gone.wait()
    me = {"net": os.readlink("/proc/self/ns/net"), "user": os.readlink("/proc/self/ns/user")}
    h = {"pid": gone.pid, **me, "started": "1"}
    (tmp_path / private.HOLDER_FILE).write_text(json.dumps(h))
    procs = []
    try:
        other = tmp_path / "other.json"  # a holder of a network of its own, tagged here too
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "spotctl.providers.local.private", "hold", str(other)],
            env={**os.environ, TAG_VAR: f"{tmp_path}/n0"}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        while not other.exists() and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not other.exists():
            pytest.skip("no network namespace for an ordinary process here")
        assert json.loads(other.read_text())["net"] != me["net"]
        assert private.holder(tmp_path) is None  # none stands in yet: n0 is in another net
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                      env={**os.environ, TAG_VAR: f"{tmp_path}/n1"}))
        assert private._recorded(tmp_path) == (h, False)
        deadline = time.monotonic() + 20
        while (got := private.holder(tmp_path)) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until the child's environment is readable
        assert got == {**h, "pid": procs[1].pid}
    finally:
        for p in procs:
            p.kill()
            p.wait()
