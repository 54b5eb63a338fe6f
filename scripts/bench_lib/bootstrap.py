"""Bootstrap of many nodes over SSH: spotctl's bootstrap_hosts against a real sshd on
loopback and the real head, next to the serial loop and to the old scheme (8 slots, each
held until its host's heartbeat).

Every node is a distinct node directory reached through one loopback sshd (as root), gets
the real rendered files (script, unit, config, token) uploaded over SFTP, runs the real
bootstrap.sh (`ensure`: deps check, setsid start) and starts a stand-in agent: a small
python loop that posts the node's heartbeat to the head with its per-node token, after
sleeping as long as the real agent's imports take here (measured at the start of the run:
`import spotctl.cli.app, spotctl.agent.supervisor`). The stand-in replaces torchrun +
training, which 64 copies of would not fit on this machine; the install is the "deps
present" path (this interpreter), so the figures measure the control plane: SSH, uploads,
the script, the start and the first heartbeat, all 64 "hosts" sharing this machine's CPUs
(on a cloud each host installs on its own). The package row measures what delivery adds
on the controller (wheel + wheelhouse, cold and cached).

With `install_s`, each host's install takes that long on the host's side: the bootstrap's
deps check runs through a wrapper that sleeps first (a remote host installing costs the
controller no CPU; a sleep stands for it), so that the rows show what holding SSH slots
means when installs are slow, as on a cloud.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .core import Context

SSHD = "/usr/sbin/sshd"

HEARTBEAT = """
import json, sys, time, urllib.request
url, node, token_file, startup_s = sys.argv[1:5]
time.sleep(float(startup_s))
token = open(token_file).read().strip()
body = json.dumps({"node_id": node, "agent_state": "waiting"}).encode()
while True:
    try:
        req = urllib.request.Request(url + "/api/heartbeat", data=body, method="POST",
            headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()
    except Exception:
        pass
    time.sleep(2)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


@contextmanager
def sshd(work: Path) -> Iterator[tuple[int, Path]]:
    """A loopback sshd for root with a fresh client key: (port, client key)."""
    work.mkdir(parents=True, exist_ok=True, mode=0o700)
    host_key, client = _keygen(work / "host"), _keygen(work / "client")
    auth = work / "authorized_keys"
    auth.write_text(Path(str(client) + ".pub").read_text())
    port = _free_port()
    sftp = next((p for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server")
                 if os.path.exists(p)), "internal-sftp")  # fmt: skip
    cfg = work / "sshd_config"
    cfg.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nPidFile {work}/sshd.pid\n"
        f"AuthorizedKeysFile {auth}\nPasswordAuthentication no\nPubkeyAuthentication yes\n"
        "PermitRootLogin yes\nStrictModes no\nUsePAM no\nMaxStartups 200:30:400\n"
        f"MaxSessions 100\nSubsystem sftp {sftp}\n"
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("bench sshd did not start")
            time.sleep(0.1)
        yield port, client
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def head(work: Path) -> Iterator[tuple[str, int, str]]:
    """The real `spotctl head` on loopback: (url, store port, cluster token)."""
    work.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    tf = work / "token"
    fd = os.open(tf, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, token.encode())
    os.close(fd)
    api, store = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotctl.cli.app", "head", "--dir", str(work / "head"),
         "--token-file", str(tf), "--host", "127.0.0.1", "--http-port", str(api),
         "--store-port", str(store)],
        stdout=open(work / "head.log", "ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{api}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                req = urllib.request.Request(
                    url + "/api/health", headers={"Authorization": f"Bearer {token}"}
                )
                with urllib.request.urlopen(req, timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("bench head did not start") from None
                time.sleep(0.2)
        yield url, store, token
    finally:
        proc.terminate()
        proc.wait(15)


def _kill_nodes(root: Path) -> None:
    for pidfile in root.glob("*/agent.pid"):
        try:
            os.killpg(int(pidfile.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def agent_import_s() -> float:
    """How long the real agent's imports take on this machine (one cold process)."""
    code = "import spotctl.cli.app, spotctl.agent.supervisor"
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t


def run_bootstrap(
    work: Path,
    port: int,
    key: Path,
    url: str,
    store: int,
    token: str,
    nodes: int,
    mode: str,
    startup_s: float = 0.0,
    install_s: float = 0.0,
) -> tuple[float, int]:
    """Bootstrap `nodes` fresh node directories; (seconds until every heartbeat, ok hosts).
    mode: "spotctl" (bootstrap_hosts, 32 SSH slots, heartbeats awaited outside them),
    "serial" (one host at a time, each until its heartbeat), "old8" (8 slots, each held
    until its host's heartbeat: the scheme before)."""
    from spotctl.agent.config import AgentConfig
    from spotctl.head.auth import node_token
    from spotctl.remote.bootstrap import (
        AGENT_CONFIG,
        BootstrapFiles,
        HeadProbe,
        HostResult,
        HostTarget,
        bootstrap_hosts,
        render_bootstrap,
    )

    root = work / f"{mode}-{secrets.token_hex(4)}"
    root.mkdir(parents=True)
    python = sys.executable
    if install_s:
        python = str(root / "python-installing")
        Path(python).write_text(f'#!/bin/sh\nsleep {install_s}\nexec {sys.executable} "$@"\n')
        os.chmod(python, 0o755)
    known = work / "known_hosts"
    targets = [HostTarget(f"n{i:03d}", "127.0.0.1", port, "root", str(key), str(root / f"n{i:03d}"))
               for i in range(nodes)]  # fmt: skip

    def render(t: HostTarget) -> BootstrapFiles:
        cfg = AgentConfig(cluster="bench", node_id=t.node_id, head_url=url,
                          store_host="127.0.0.1", store_port=store, token_file="", workdir="",
                          script="train.py")  # fmt: skip
        d = t.remote_dir
        argv = [sys.executable, "-X", f"spotctl_node={d}/{AGENT_CONFIG}", "-c", HEARTBEAT,
                url, t.node_id, f"{d}/token", f"{startup_s:.2f}"]  # fmt: skip
        return render_bootstrap(t, cfg, node_token(token, t.node_id), python=python,
                                agent_argv=argv)  # fmt: skip

    probe = HeadProbe(url, token)
    kw = dict(probe=probe, heartbeat_timeout_s=300.0, wait_s=30.0)
    t0 = time.perf_counter()
    results: list[HostResult] = []
    try:
        if mode == "spotctl":
            results = bootstrap_hosts(targets, render, known, 32, None, **kw)  # type: ignore[arg-type]
        elif mode == "serial":
            for t in targets:
                results += bootstrap_hosts([t], render, known, 1, None, **kw)  # type: ignore[arg-type]
        else:  # old8: a slot is held until that host's heartbeat
            lock = threading.Lock()
            todo = list(targets)

            def worker() -> None:
                while True:
                    with lock:
                        if not todo:
                            return
                        t = todo.pop(0)
                    r = bootstrap_hosts([t], render, known, 1, None, **kw)  # type: ignore[arg-type]
                    with lock:
                        results.extend(r)

            threads = [threading.Thread(target=worker) for _ in range(8)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        return time.perf_counter() - t0, sum(1 for r in results if r.ok)
    finally:
        _kill_nodes(root)
        shutil.rmtree(root, ignore_errors=True)


def package_times(work: Path) -> tuple[float, float]:
    """Seconds to build the node package cold (empty cache) and again in a new process
    (cache hit: wheels reused, only hashing)."""
    cache = work / "pkg-cache"
    code = ("import time, sys; from pathlib import Path; "
            "from spotctl.remote import package as p\n"
            "for _ in range(2):\n"
            "    p._memo.clear(); t = time.perf_counter(); p.node_package(Path(sys.argv[1]))\n"
            "    print(time.perf_counter() - t)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code, str(cache)], capture_output=True,
                       text=True, check=True)  # fmt: skip
    cold, warm = (float(x) for x in r.stdout.split()[-2:])
    return cold, warm


def available() -> str:
    """Why the SSH bootstrap bench cannot run here, or ""."""
    if not os.path.exists(SSHD) or not shutil.which("ssh-keygen"):
        return "no OpenSSH sshd (scripts/install-sshd)"
    if os.geteuid() != 0:
        return "the loopback sshd logs in as root"
    return ""


INSTALL_S = 10.0  # the emulated host-side install of the "slow install" rows


def measure(ctx: Context, nodes: int, reps: int,
            install_s: float = INSTALL_S) -> dict[str, list[float]]:  # fmt: skip
    """{mode: seconds per rep}; a rep where some host failed is logged and kept out.
    Modes: spotctl, serial, old8 (deps present) and spotctl+install, old8+install (each
    host's install takes `install_s` on its side)."""
    work = ctx.subdir("bootstrap")
    out: dict[str, list[float]] = {
        "spotctl": [], "serial": [], "old8": [], "spotctl+install": [], "old8+install": []
    }  # fmt: skip
    startup = agent_import_s()
    ctx.log(f"bootstrap: the stand-in agent waits {startup:.2f}s (the agent's imports here)")
    with sshd(work / "sshd") as (port, key), head(work / "head") as (url, store, token):
        run_bootstrap(work, port, key, url, store, token, 2, "spotctl")  # warm, pin the key
        for _ in range(reps):
            for name in out:
                mode, _, inst = name.partition("+")
                dt, ok = run_bootstrap(work, port, key, url, store, token, nodes, mode, startup,
                                       install_s if inst else 0.0)  # fmt: skip
                if ok == nodes:
                    out[name].append(dt)
                else:
                    ctx.log(f"bootstrap {name}: only {ok}/{nodes} hosts ok; rep dropped")
    return out
