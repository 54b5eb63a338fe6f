"""A local cluster on a private network (`[local] private_network = true`): the head's API
and store, the torchft Lighthouse, each node's metadata endpoint and the workers' own
listeners all bind loopback, which every user of a shared machine can reach. In the
cluster's own network namespace nobody outside it can: tried here by this process and by
another user, while the cluster trains (judged by the workers' own step logs) and the CLI
drives it (status, a notice, down)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, last_step, node_steps, up_ft_train, wait_until

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="another user's attempts are made with runuser (root)")

OTHER_USER = "daemon"

# ctypes setns into a network namespace: what an outsider would try
JOIN = textwrap.dedent("""
    import ctypes, os, sys
    fd = os.open(sys.argv[1], os.O_RDONLY)
    libc = ctypes.CDLL(None, use_errno=True)
    print("joined" if libc.setns(fd, 0x40000000) == 0 else f"errno {ctypes.get_errno()}")
""")
# an HTTP GET with the cluster's token: what answers there, if anything
GET = textwrap.dedent("""
    import sys, urllib.request
    req = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer " + sys.argv[2]})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5) as r:
            print("answered", r.status)
    except Exception as e:
        print("failed", type(e).__name__)
""")


# connects to 127.0.0.1:argv[1]; exit 0 only when what answers says argv[2] (another
# listener that happens to have the same port number out here does not)
PROBE = textwrap.dedent("""
    import socket, sys
    try:
        with socket.create_connection(("127.0.0.1", int(sys.argv[1])), 3) as s:
            s.settimeout(3)
            sys.exit(0 if s.recv(64).decode() == sys.argv[2] else 3)
    except OSError:
        sys.exit(2)
""")


def _as_other(code: str, *args: str) -> str:
    r = subprocess.run(["runuser", "-u", OTHER_USER, "--", "/usr/bin/python3", "-c", code, *args],
                       capture_output=True, text=True, timeout=60, cwd="/")
    return (r.stdout + r.stderr).strip()


def _get(url: str, token: str) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5) as r:
            return f"answered {r.status}"
    except (urllib.error.URLError, OSError) as e:
        return f"failed {type(e).__name__}"


def _net(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _gone(pid: int) -> bool:
    try:  # gone, or a zombie its new parent has not reaped yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _listening(pid: int, port: int) -> bool:
    """A socket in `pid`'s network namespace listens on `port` (/proc/PID/net/tcp*)."""
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft")
def test_a_private_cluster_trains_while_no_one_outside_reaches_its_listeners(
    local_cluster: Any,
) -> None:
    c = local_cluster("prv")
    c.in_process = False  # status through the CLI, which joins the cluster's network
    # the default (private_network unset; the harness otherwise keeps its clusters on
    # loopback to read them from this process)
    logs = up_ft_train(c, 2, spec_extra="[local]\n# private_network: unset\n")
    holder = json.loads((c.cluster_dir / "private-net.json").read_text())
    assert holder["net"] != _net("self")

    # every process of the cluster lives in its network: head, nodes, agents, workers
    procs = c.processes()
    assert len(procs) >= 6, procs
    assert {_net(p) for p in procs} == {holder["net"]}, procs
    pids = {n: node_steps(logs, n)[-1]["pid"] for n in ("n1", "n2")}
    assert all(_net(p) == holder["net"] for p in pids.values())

    # its listeners are there, and not here
    head = json.loads((c.cluster_dir / "head" / "head.json").read_text())
    token = c.cluster_dir.joinpath("token").read_text().strip()
    http_port = int(head["url"].rsplit(":", 1)[1])
    lighthouse = head["lighthouse"]
    ports = {"head API": http_port, "store": int(head["store_port"]),
             "Lighthouse": int(lighthouse.rsplit(":", 1)[1])}
    vms = {n: json.loads((c.cluster_dir / "nodes" / n / "vm.json").read_text())
           for n in ("n1", "n2")}
    for n, vm in vms.items():
        ports[f"{n}'s metadata"] = int(vm["metadata_url"].rsplit(":", 1)[1])
    for what, port in ports.items():
        assert _listening(int(head["pid"]), port), f"the {what} port {port} is not the cluster's"
    # what only these listeners grant to the cluster's token (200): another cluster's that
    # happens to have the same port number out here would refuse it (401); the
    # Lighthouse's status page asks no token, so the namespaces above stand for it
    urls = {"head API": head["url"] + "/api/health",
            **{f"{n}'s metadata": vm["metadata_url"] + "/_spotctl/state"
               for n, vm in vms.items()}}
    for what, url in urls.items():
        inside = subprocess.run(
            [sys.executable, "-c", "import sys; from spotctl.providers.local import private\n"
             "private.JOIN = True; private.join(__import__('pathlib').Path(sys.argv[3]))\n"
             + GET, url, token, str(c.cluster_dir)],
            env=c.env, capture_output=True, text=True, timeout=60).stdout.strip()
        assert inside == "answered 200", (what, inside)  # the probe itself works
        mine, theirs = _get(url, token), _as_other(GET, url, token)
        assert mine != "answered 200", (what, mine)
        assert theirs != "answered 200", (what, theirs)
    # and another user cannot join it (this process, root, could)
    joined = _as_other(JOIN, f"/proc/{holder['pid']}/ns/net")
    assert joined == "errno 1" or "PermissionError" in joined, joined  # setns or open refused

    # the CLI reaches it: status, and a notice the survivor trains through
    st = c.status()
    assert st["world_size"] == 2 and not st.get("head_error"), st
    mark = last_step(logs, "n1")
    c.cli("preempt", "n2", "--style", "gcp")
    wait_until(lambda: any(s["replicas"] == 1 and s["step"] > mark
                           for s in node_steps(logs, "n1")), 120,
               "n1 training on alone after n2's notice", 0.5, c.debug)
    n1 = node_steps(logs, "n1")
    steps = [s["step"] for s in n1]
    assert steps == list(range(1, len(steps) + 1)), steps
    assert {s["pid"] for s in n1} == {pids["n1"]}, "n1's worker was restarted"

    # the holder killed: the namespace lives on in the cluster's processes, and the CLI
    # still reaches it through one of them (and takes it down)
    os.kill(holder["pid"], signal.SIGKILL)
    wait_until(lambda: _gone(holder["pid"]), 10, "the holder to end", 0.1)
    st = c.status()
    assert st["world_size"] == 1 and not st.get("head_error"), st
    c.cli("down", "--name", "prv", "--yes")
    wait_until(lambda: not c.processes(), 30, "the cluster's processes to end", 0.5)
    assert not (c.cluster_dir / "private-net.json").exists()


def test_an_ordinary_user_gets_a_private_network_no_other_user_can_join(
    tmp_path: Path, interpreter_reachable: None
) -> None:
    """The holder as an ordinary user (a user namespace of its own owning the network):
    its loopback answers inside, nothing outside reaches it, and another user cannot join
    it."""
    d = Path(f"/tmp/spotctl-prv-{os.getpid()}")
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    owner = "nobody"
    inside = textwrap.dedent(f"""
        import os, socket, subprocess, sys, threading, time
        PROBE = {PROBE!r}
        from pathlib import Path
        from spotctl.providers.local import private
        private.JOIN = True
        d = Path({str(d)!r})
        h = private.start(d, {{}})
        private.enter(h)
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
        port = s.getsockname()[1]
        secret = os.urandom(8).hex()  # what only this listener says
        (d / "secret").write_text(secret)
        def serve():
            while True:
                c, _ = s.accept()
                c.sendall(secret.encode())
                c.close()
        threading.Thread(target=serve, daemon=True).start()
        # a child (as the cluster's processes are) reaches it
        r = subprocess.run([sys.executable, "-c", PROBE, str(port), secret])
        (d / "port").write_text(f"{{port}} {{r.returncode}}")
        while not (d / "done").exists():
            time.sleep(0.1)
        private.stop(d)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(["runuser", "-u", owner, "--", sys.executable, "-c", inside],
                         env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        got = wait_until(lambda: (d / "port").exists() and (d / "port").read_text(), 30,
                         "the owner's listener inside", 0.1,
                         lambda: p.stdout.read() if p.poll() is not None and p.stdout else "")
        port, child_rc = (int(x) for x in str(got).split())
        assert child_rc == 0, "a child inside could not reach the listener"
        holder = json.loads((d / "private-net.json").read_text())
        assert holder["user"] != os.readlink("/proc/self/ns/user")  # a user namespace of its own
        secret = (d / "secret").read_text()
        for who in ("root", OTHER_USER):
            r = subprocess.run(["runuser", "-u", who, "--", "/usr/bin/python3", "-c", PROBE,
                                str(port), secret], capture_output=True, text=True, timeout=30)
            assert r.returncode != 0, (who, r.stdout, r.stderr)
        joined = _as_other(JOIN, f"/proc/{holder['pid']}/ns/net")
        assert joined == "errno 1" or "PermissionError" in joined, joined
        joined_user = _as_other(JOIN.replace("0x40000000", "0x10000000"),
                                f"/proc/{holder['pid']}/ns/user")
        assert joined_user != "joined", joined_user
        (d / "done").write_text("")
        assert p.wait(30) == 0, p.stdout.read() if p.stdout else ""
        wait_until(lambda: _gone(holder["pid"]), 10, "the holder to end", 0.1)
    finally:
        (d / "done").write_text("")
        if p.poll() is None:
            p.kill()
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_a_command_that_has_started_threads_starts_again_inside(
    tmp_path: Path, interpreter_reachable: None
) -> None:
    """A command with threads (a terminal's spinner) cannot join a user namespace: it
    starts again as a fresh process that joins first thing, and goes on inside."""
    d = Path(f"/tmp/spotctl-prv-{os.getpid()}-t")
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    program = textwrap.dedent(f"""
        import json, os, threading, time
        from pathlib import Path
        from spotctl.providers.local import private
        private.JOIN = True
        d = Path({str(d)!r})
        with open(d / "runs", "a") as f:
            f.write("run\\n")
        private.join_from_env()  # what spotctl's main does first
        h = private.holder(d) or private.start(d, {{}})
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        private.enter(h)  # restarts this program once, then finds itself inside
        (d / "inside").write_text(json.dumps({{"net": os.readlink("/proc/self/ns/net"),
                                              "holder": h["net"]}}))
        private.stop(d)
    """)
    try:
        r = subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-c", program],
                           env=dict(os.environ, PYTHONPATH=str(REPO)), cwd="/",
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        got = json.loads((d / "inside").read_text())
        assert got["net"] == got["holder"] != os.readlink("/proc/self/ns/net")
        assert (d / "runs").read_text() == "run\nrun\n"  # started once more, not in a loop
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)
