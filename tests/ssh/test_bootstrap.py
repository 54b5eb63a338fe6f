"""Bootstrap over a real sshd on loopback: parallel hosts, idempotence, failures, host keys,
and secrets (0600 files, token on no command line)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from spotctl.agent.config import AgentConfig
from spotctl.remote.bootstrap import (
    BootstrapFiles,
    HeadProbe,
    HostResult,
    HostTarget,
    bootstrap_hosts,
    release_hosts,
    render_bootstrap,
)
from spotctl.remote.ssh import run_remote, ssh_argv, tail_log

from .conftest import Head, Sshd, SshdFactory, free_port

pytestmark = pytest.mark.ssh


def _target(sshd_port: int, node: str, tmp: Path, key: Path) -> HostTarget:
    return HostTarget(node, "127.0.0.1", sshd_port, "root", str(key), str(tmp / "remote" / node))


def _renderer(head: Head, args: list[str] | None = None):
    """The real agent (`<python> -m spotctl.cli.app agent --config ...`), real head."""

    def render(t: HostTarget) -> BootstrapFiles:
        cfg = AgentConfig(
            cluster="c1",
            node_id=t.node_id,
            head_url=head.url,
            store_host="127.0.0.1",
            store_port=head.store_port,
            token_file="",
            workdir="",
            script=str(head.script),
            args=args or [],
            max_nodes=2,
        )
        return render_bootstrap(t, cfg, head.token, python=sys.executable)

    return render


def _batch(argv: list[str]) -> list[str]:
    """No prompts from the ssh binary in tests."""
    return argv[:1] + ["-o", "BatchMode=yes"] + argv[1:]


def _pid(t: HostTarget) -> int:
    return int((Path(t.remote_dir) / "agent.pid").read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not a running agent
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.fixture
def cleanup_agents():
    pids: list[int] = []
    yield pids
    for p in pids:
        try:
            os.killpg(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _ok(results: list[HostResult]) -> None:
    assert all(r.ok for r in results), [r.reason for r in results]


@pytest.mark.slow  # over 4 s: out of the fast set
def test_two_hosts_parallel_then_idempotent(
    sshd_factory: SshdFactory,
    client_key: Path,
    tmp_path: Path,
    head: Head,
    cleanup_agents: list[int],
) -> None:
    a, b = sshd_factory.start(), sshd_factory.start()
    hosts = [
        _target(a.port, "n1", tmp_path, client_key),
        _target(b.port, "n2", tmp_path, client_key),
    ]
    kh = tmp_path / "cluster" / "known_hosts"
    probe = HeadProbe(head.url, head.token)

    first = bootstrap_hosts(
        hosts,
        _renderer(head),
        kh,
        parallel=2,
        progress=None,
        wait_s=5,
        probe=probe,
        heartbeat_timeout_s=30,
    )
    _ok(first)
    cleanup_agents.extend(_pid(h) for h in hosts)
    assert [r.node_id for r in first] == ["n1", "n2"]
    assert all(r.changed for r in first)
    assert set(head.status()["nodes"]) == {"n1", "n2"}
    pids = [_pid(h) for h in hosts]
    assert all(_alive(p) for p in pids)

    # first contact pinned both host keys, in the cluster's file only
    pinned = kh.read_text()
    assert f"[127.0.0.1]:{a.port} ssh-ed25519 {a.host_pub}" in pinned
    assert f"[127.0.0.1]:{b.port} ssh-ed25519 {b.host_pub}" in pinned
    assert stat.S_IMODE(kh.stat().st_mode) == 0o600

    second = bootstrap_hosts(
        hosts,
        _renderer(head),
        kh,
        parallel=2,
        progress=None,
        wait_s=5,
        probe=probe,
        heartbeat_timeout_s=30,
    )
    _ok(second)
    assert [r.changed for r in second] == [False, False], second
    assert [r.uploaded for r in second] == [[], []]
    assert [_pid(h) for h in hosts] == pids, "an unchanged agent must not be restarted"
    assert kh.read_text() == pinned

    # a config change restarts exactly that configuration's agent
    third = bootstrap_hosts(
        hosts[:1],
        _renderer(head, ["--lr", "0.1"]),
        kh,
        progress=None,
        wait_s=5,
        probe=probe,
        heartbeat_timeout_s=30,
    )
    _ok(third)
    assert third[0].changed and third[0].uploaded == ["agent.json"]
    cleanup_agents.append(_pid(hosts[0]))
    assert _pid(hosts[0]) != pids[0] and not _alive(pids[0])
    assert _pid(hosts[1]) == pids[1]


@pytest.mark.slow  # over 4 s: out of the fast set
def test_secrets_are_private_and_off_command_lines(
    sshd: Sshd, client_key: Path, tmp_path: Path, head: Head, cleanup_agents: list[int]
) -> None:
    t = _target(sshd.port, "n1", tmp_path, client_key)
    kh = tmp_path / "known_hosts"
    [r] = bootstrap_hosts(
        [t],
        _renderer(head),
        kh,
        progress=None,
        wait_s=5,
        probe=HeadProbe(head.url, head.token),
        heartbeat_timeout_s=30,
    )
    assert r.ok, r.reason
    pid = _pid(t)
    cleanup_agents.append(pid)
    d = Path(t.remote_dir)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("token", "agent.json"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
    assert (d / "token").read_text().strip() == head.token

    # the token is on no process's command line or in the agent's environment
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            assert head.token.encode() not in cmdline, f"token in argv of pid {proc.name}"
    assert head.token.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    assert f"{d}/agent.json".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    for log in d.glob("*.log"):
        assert head.token not in log.read_text()

    # a token made readable by someone is made private again, without a restart
    os.chmod(d / "token", 0o644)
    [r2] = bootstrap_hosts([t], _renderer(head), kh, progress=None, wait_s=5)
    assert r2.ok and not r2.changed
    assert stat.S_IMODE((d / "token").stat().st_mode) == 0o600
    assert _pid(t) == pid

    # release stops the agent and removes the token from the host
    [rel] = release_hosts([t], kh)
    assert rel.ok and rel.changed, rel.reason
    assert not _alive(pid)
    assert not (d / "token").exists()


def test_one_host_down_the_other_fine(
    sshd: Sshd, client_key: Path, tmp_path: Path, head: Head, cleanup_agents: list[int]
) -> None:
    dead_port = free_port()  # nothing listens here
    hosts = [
        _target(dead_port, "down", tmp_path, client_key),
        _target(sshd.port, "up", tmp_path, client_key),
    ]
    down, up = bootstrap_hosts(
        hosts,
        _renderer(head),
        tmp_path / "kh",
        parallel=2,
        progress=None,
        wait_s=1.5,
        attempt_timeout_s=2,
    )
    assert up.ok and up.changed, up.reason
    cleanup_agents.append(_pid(hosts[1]))
    assert not down.ok and not down.changed
    assert "down (root@127.0.0.1:" in down.reason and "unreachable" in down.reason
    assert "refused" in down.reason.lower()


def test_changed_host_key_is_refused(
    sshd_factory: SshdFactory,
    client_key: Path,
    tmp_path: Path,
    head: Head,
    cleanup_agents: list[int],
) -> None:
    from .conftest import keygen

    s1 = sshd_factory.start()
    t = _target(s1.port, "n1", tmp_path, client_key)
    kh = tmp_path / "known_hosts"
    [r] = bootstrap_hosts([t], _renderer(head), kh, progress=None, wait_s=5)
    assert r.ok, r.reason
    cleanup_agents.append(_pid(t))
    pinned = kh.read_text()

    # same address and port, new machine identity (e.g. rebuilt, or someone in the middle)
    s1.stop()
    new_key = keygen(tmp_path / "other_host_key")
    sshd_factory.start(port=s1.port, host_key=new_key)
    fp = subprocess.run(
        ["ssh-keygen", "-lf", str(new_key) + ".pub"], capture_output=True, text=True, check=True
    ).stdout.split()[1]
    [r2] = bootstrap_hosts([t], _renderer(head), kh, progress=None, wait_s=5)
    assert not r2.ok
    assert f"host key for [127.0.0.1]:{s1.port} changed" in r2.reason
    assert fp in r2.reason and str(kh) in r2.reason
    assert kh.read_text() == pinned, "a changed key must never be recorded"

    # the system ssh client, pinned the same way, refuses too
    p = subprocess.run(
        _batch(ssh_argv(t, kh, ["true"])), capture_output=True, text=True, timeout=30
    )
    assert p.returncode != 0 and "HOST IDENTIFICATION HAS CHANGED" in p.stderr


def test_run_remote_ssh_binary_and_tail_log(sshd: Sshd, client_key: Path, tmp_path: Path) -> None:
    t = _target(sshd.port, "n1", tmp_path, client_key)
    kh = tmp_path / "known_hosts"
    r = run_remote(t, "echo hello; echo oops >&2; exit 3", kh)
    assert (r.exit_code, r.stdout, r.stderr) == (3, "hello\n", "oops\n")

    # the system ssh binary with the same pinned file works (key recorded above)
    p = subprocess.run(
        _batch(ssh_argv(t, kh, ["echo", "it's here"])), capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == "it's here\n"

    log = tmp_path / "some.log"
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    import io

    buf = io.StringIO()
    assert tail_log(t, str(log), kh, lines=3, out=buf) == 0
    assert buf.getvalue() == "line 7\nline 8\nline 9\n"


def test_wait_for_ssh_while_host_boots(
    sshd_factory: SshdFactory,
    client_key: Path,
    tmp_path: Path,
    head: Head,
    cleanup_agents: list[int],
) -> None:
    """The host's sshd comes up a little after the bootstrap starts (a booting VM)."""
    import threading

    port = free_port()
    t = _target(port, "late", tmp_path, client_key)
    timer = threading.Timer(1.5, lambda: sshd_factory.start(port=port))
    timer.start()
    try:
        [r] = bootstrap_hosts([t], _renderer(head), tmp_path / "kh", progress=None, wait_s=60)
    finally:
        timer.join()
    assert r.ok, r.reason
    cleanup_agents.append(_pid(t))
