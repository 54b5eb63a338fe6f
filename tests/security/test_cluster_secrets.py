"""Issue 9, security on a running local cluster (real head, agents, torchrun, workers): the
token never shows in any process's command line or environment, nor in logs or journals;
files that hold it are 0600 and directories 0700; the head and the metadata endpoints
listen on loopback only."""

from __future__ import annotations

import json
import socket
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import local_cluster  # noqa: F401  (the fixture, shared with e2e)

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(300)]


def _listening(pids: list[int]) -> dict[int, list[tuple[str, int]]]:
    """{pid: [(ip, port)]} of the TCP sockets each pid listens on (IPv4 and IPv6)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    link = fd.readlink().as_posix()
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            continue
    out: dict[int, list[tuple[str, int]]] = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexip, hexport = f[1].split(":")
            if v6:
                ip = (
                    "::1"
                    if hexip == "0" * 24 + "01000000"
                    else ("::" if set(hexip) == {"0"} else hexip)
                )
            else:
                ip = ".".join(str(int(hexip[i : i + 2], 16)) for i in (6, 4, 2, 0))
            out.setdefault(inodes[f[9]], []).append((ip, int(hexport, 16)))
    return out


def _get(url: str, token: str) -> int:
    return _post(url, token, None)


def _post(url: str, token: str, body: dict[str, Any] | None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_running_cluster_keeps_its_token_secret(local_cluster) -> None:  # noqa: F811
    c = local_cluster("sec")
    c.write_spec("2", checkpoint_every=10)
    c.cli("up", "--wait", "120")
    c.steps_advance(world=2, by=3, timeout=180)

    token = (c.cluster_dir / "token").read_text().strip()
    assert len(token) >= 32
    pids = c.processes()
    roles = {pid: _cmd(pid) for pid in pids}
    # head, 2 x (local vm, agent, torchrun, worker) at least
    # the head server and the supervisor that restarts it
    assert sum("spotctl.cli.app head" in x and "--supervise" not in x
               for x in roles.values()) == 1, roles
    assert sum("spotctl.cli.app head" in x and "--supervise" in x
               for x in roles.values()) == 1, roles
    assert sum("spotctl.cli.app agent" in x for x in roles.values()) == 2, roles
    assert sum("torch.distributed.run" in x for x in roles.values()) == 2, roles
    assert len(pids) >= 9, roles

    # 1. no command line and no environment holds the token
    for pid in pids:
        for what in ("cmdline", "environ"):
            try:
                raw = Path(f"/proc/{pid}/{what}").read_bytes()
            except OSError:
                continue  # exited meanwhile
            assert token.encode() not in raw, f"token in /proc/{pid}/{what}: {roles[pid]}"

    # 2. only the 0600 token files hold it; logs, journals, configs and state never do
    holders = []
    for p in [*c.home.rglob("*")]:
        if p.is_file() and token.encode() in p.read_bytes():
            holders.append(p)
    assert holders, "the token file itself must be found (the scan works)"
    for p in holders:
        assert p.name == "token", f"token leaked into {p}"
        assert p.parent == c.cluster_dir, f"the cluster secret was given to a node: {p}"
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    logs = [*c.cluster_dir.rglob("*.log"), *c.cluster_dir.rglob("*.jsonl")]
    assert any(p.name == "torchrun.log" for p in logs) and any(p.name == "head.log" for p in logs)

    # 3. directories that lead to secrets are private
    for d in (
        c.home,
        c.cluster_dir,
        c.cluster_dir / "head",
        c.cluster_dir / "nodes",
        *[p for p in (c.cluster_dir / "nodes").iterdir() if p.is_dir()],
    ):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, f"{d} is {oct(d.stat().st_mode)}"

    # 4. the head and every node's metadata endpoint listen on loopback only
    listening = _listening(pids)
    head_pid = next(p for p, x in roles.items()
                    if "spotctl.cli.app head" in x and "--supervise" not in x)
    vm_pids = [p for p, x in roles.items() if "spotctl.providers.local.vm" in x]
    assert len(listening.get(head_pid, [])) >= 2  # API + rendezvous store
    for pid in [head_pid, *vm_pids]:
        assert listening.get(pid), f"pid {pid} listens on nothing? {roles[pid]}"
        for ip, port in listening[pid]:
            assert ip in ("127.0.0.1", "::1"), f"{roles[pid]} listens on {ip}:{port}"
    others = {
        roles[p][:80]: addrs
        for p, addrs in listening.items()
        if any(ip not in ("127.0.0.1", "::1") for ip, _ in addrs)
    }
    # the workers' own store (rank 0) and gloo listen on the node's address only
    assert others == {}, f"non-loopback listeners: {others}"

    # 5. ...and a client from outside loopback (this machine's other addresses) is refused
    # by every listener of the cluster: head API, head store, workers' store, gloo, metadata
    from tests.security.test_head_api import _outside_addresses

    ports = sorted({port for addrs in listening.values() for _, port in addrs})
    assert ports
    for ip in _outside_addresses():
        for port in ports:
            with pytest.raises(OSError):
                socket.create_connection((ip, port), timeout=2).close()

    # 6. each node holds its own credential (not the cluster secret); it speaks for that
    # node only and opens no controller route; workers' environments hold none
    head_url = json.loads((c.cluster_dir / "head" / "head.json").read_text())["url"]
    node_dirs = [p for p in (c.cluster_dir / "nodes").iterdir() if p.is_dir()]
    node_tokens = {p.name: (p / "token").read_text().strip() for p in node_dirs}
    assert len(node_tokens) == 2
    for nid, nt in node_tokens.items():
        assert nt != token and token not in nt and nt.startswith(f"node:{nid}:")
        assert _get(head_url + "/api/health", nt) == 200
        assert _get(head_url + "/api/status", nt) == 403
        other = next(n for n in node_tokens if n != nid)
        assert _post(head_url + "/api/notice", nt, {"node_id": other, "notice": {
            "id": "forged", "deadline": time.time() + 30}}) == 403
        for pid in pids:
            if "spotctl.cli.app agent" in roles[pid]:
                continue  # the agent itself holds its token in memory, not in its env
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            assert nt.encode() not in env, f"node token in env of {roles[pid]}"
    assert _get(head_url + "/api/status", token) == 200
    c.cli("down", "--name", "sec", "--yes")
    assert c.processes() == []
