"""Scenarios of issue 14 on the shared local cluster: the control plane trusts no one.

15 forged notice from another node: node B's own credential tries to speak for node A
   (notice, "left" heartbeat, event); the head refuses each, the job trains on untouched.
16 head fed garbage for 30 s while training: random bytes, bad Content-Lengths, deep or
   broken JSON, forged tokens, random routes and a few stalled connections, from several
   threads; the head neither dies nor restarts, no node goes unresponsive, steps advance.
17 rebalance racing down: cron-style `rebalance` runs start around a `down`; afterwards
   nothing runs (no head, no node), and the job's committed checkpoints are all there.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from . import replays
from .cluster import Cluster
from .result import Result


def _head(c: Cluster) -> dict[str, Any]:
    return json.loads((c.cluster_dir / "head" / "head.json").read_text())


def _call(url: str, token: str, body: dict[str, Any]) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _rescales_since(c: Cluster, n0: int) -> list[dict[str, Any]]:
    return c.events("rescale")[n0:]


def forged_notice(c: Cluster, world: int) -> Result:
    res = Result("15 forged notice from another node", not_applicable=["recover_s"])
    nodes = sorted(c.live_nodes(), key=lambda s: int(s[1:]))
    victim, attacker = nodes[0], nodes[-1]
    token = (c.cluster_dir / "nodes" / attacker / "token").read_text().strip()
    url = _head(c)["url"]
    n_resc = len(c.events("rescale"))
    n_notice = len(c.events("notice"))
    st0 = c.status()
    before = max(c.committed(), default=0)
    window = c.replay_window()
    deadline = time.time() + 60
    codes = {
        "notice": _call(url + "/api/notice", token, {"node_id": victim, "notice": {
            "id": "forged", "source": "attacker", "kind": "preemption",
            "deadline": deadline}}),
        "heartbeat-left": _call(url + "/api/heartbeat", token, {
            "node_id": victim, "agent_state": "left", "workers": []}),
        "event": _call(url + "/api/event", token, {
            "type": "rebalance-recommendation", "node": victim}),
        "drain": _call(url + "/api/drain", token, {"reason": "rebalance",
                                                   "leavers": [victim]}),
        "forget": _call(url + "/api/forget", token, {"nodes": [victim]}),
    }
    st = c.training(world, past=st0["step"] + 2 * c.every, timeout=120)
    resc = _rescales_since(c, n_resc)
    forged = [e for e in c.events("notice")[n_notice:] if e.get("node") == victim]
    resume = min((int(e["resume_step"]) for e in resc), default=None)
    res.committed_steps_lost = 0 if resume is None else max(0, before - resume)
    replays.fill(res, window, sum(int(e.get("lost_steps") or 0) for e in resc))
    victim_state = st["nodes"]
    res.survived = (all(code in (401, 403) for code in codes.values()) and not forged
                    and not resc)
    res.detail.update(victim=None, attacker=attacker, target=victim, codes=codes,
                      forged_notices=forged, rescales=len(resc), nodes=victim_state)
    res.notes = f"{attacker} as {victim}: " + ", ".join(f"{k} {v}" for k, v in codes.items())
    return res


def _garbage(rng: random.Random, url_port: int, secret: str, node_token: str) -> bytes:
    kind = rng.randrange(8)
    routes = ["/api/heartbeat", "/api/notice", "/api/event", "/api/drain", "/api/forget",
              "/api/status", "/api/events", "/" + "x" * rng.randrange(50)]
    route = rng.choice(routes)
    auth = rng.choice([f"Bearer {secret}", f"Bearer {node_token}", "Bearer nope", ""])
    if kind == 0:
        return os.urandom(rng.randrange(1, 300))
    if kind == 1:
        return (f"POST {route} HTTP/1.1\r\nAuthorization: {auth}\r\n"
                f"Content-Length: -1\r\n\r\n").encode()
    if kind == 2:
        return (f"POST {route} HTTP/1.1\r\nAuthorization: {auth}\r\n"
                f"Content-Length: 99999999999\r\n\r\n").encode() + os.urandom(100)
    if kind == 3:
        body = b"[" * 5000 + b"]" * 5000
    elif kind == 4:
        # JSON of the right shape with every value wrong: never a request the head may act
        # on (with the controller's secret a *valid* request would be the controller's
        # own decision, not garbage)
        body = json.dumps({"node_id": rng.choice(["n1", "n2", "n3", "-x", "a\nb", 7]),
                           "agent_state": rng.choice(["x", 5, ["left"]]),
                           "notice": {"deadline": rng.choice(["soon", 1e400, [1]])},
                           "workers": rng.choice([[{"rank": "x"}], "w", 3]),
                           "reason": rng.choice([5, "x", None]), "nodes": "n1",
                           "type": rng.choice(["x", ["y"], 3]), "seq": 10**12,
                           "ts": "x"}, default=str).encode()
    elif kind == 5:
        body = os.urandom(rng.randrange(0, 2000))
    elif kind == 6:
        body = b'{"type": "note", "message": "' + b"m" * 100_000 + b'"}'
    else:
        body = b'{"reason": 5, "nodes": [{}], "node_id": {}}'
    return (f"POST {route} HTTP/1.1\r\nAuthorization: {auth}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def head_garbage(c: Cluster, world: int, seconds: float = 30.0) -> Result:
    res = Result(f"16 head fed garbage for {seconds:.0f} s while training",
                 not_applicable=["recover_s"])
    h = _head(c)
    port = int(h["url"].rsplit(":", 1)[1])
    secret = (c.cluster_dir / "token").read_text().strip()
    # a node credential with a wrong MAC (a real node's own would be that node speaking,
    # and flooding with it only throttles that node: its agent shares the rate limit)
    node = sorted(c.live_nodes())[0]
    ntoken = f"node:{node}:" + "0" * 64
    n_resc = len(c.events("rescale"))
    n_unresp = len(c.events("node-unresponsive"))
    st0 = c.status()
    before = max(c.committed(), default=0)
    window = c.replay_window()
    stop = threading.Event()
    sent = [0]
    answers: dict[str, int] = {}
    lock = threading.Lock()

    def storm(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            data = _garbage(rng, port, secret, ntoken)
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
                    s.sendall(data)
                    s.shutdown(socket.SHUT_WR)
                    first = s.recv(16)
                code = first.split(b" ")[1].decode() if first.startswith(b"HTTP/") else "closed"
            except OSError as e:
                code = type(e).__name__
            with lock:
                sent[0] += 1
                answers[code] = answers.get(code, 0) + 1

    def stall() -> None:
        # a few connections that send half a request and wait (until the head drops them)
        socks = []
        while not stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=3)
                s.sendall(b"POST /api/heartbeat HTTP/1.1\r\nContent-Le")
                socks.append(s)
            except OSError:
                pass
            if len(socks) > 16:
                socks.pop(0).close()
            stop.wait(0.5)
        for s in socks:
            s.close()

    threads = [threading.Thread(target=storm, args=(i,), daemon=True) for i in range(4)]
    threads.append(threading.Thread(target=stall, daemon=True))
    t0 = time.time()
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(10)
    st = c.training(world, past=st0["step"] + 5, timeout=60)
    resc = _rescales_since(c, n_resc)
    unresp = c.events("node-unresponsive")[n_unresp:]
    resume = min((int(e["resume_step"]) for e in resc), default=None)
    res.committed_steps_lost = 0 if resume is None else max(0, before - resume)
    replays.fill(res, window, sum(int(e.get("lost_steps") or 0) for e in resc))
    same_head = _head(c)["pid"] == h["pid"]
    five = {k: v for k, v in answers.items() if k.startswith("5") and k != "505"}
    res.survived = same_head and not unresp and not resc and not five and st["step"] > st0["step"]
    res.detail.update(requests=sent[0], answers=answers, head_restarted=not same_head,
                      unresponsive=unresp, rescales=len(resc), steps=[st0["step"], st["step"]],
                      seconds=round(time.time() - t0, 1))
    res.notes = (f"{sent[0]} requests in {seconds:.0f}s, answers {dict(sorted(answers.items()))}; "
                 f"steps {st0['step']}->{st['step']}")
    return res


def rebalance_racing_down(c: Cluster) -> Result:
    res = Result("17 rebalance racing down",
                 not_applicable=["steps_replayed", "recover_s"])
    before = max(c.committed(), default=0)
    procs = [c.popen("rebalance", "--name", c.name)]
    time.sleep(0.3)
    down = c.popen("down", "--name", c.name, "--yes", "--json")
    for _ in range(3):
        time.sleep(0.4)
        procs.append(c.popen("rebalance", "--name", c.name))
    outs = []
    for p in [down, *procs]:
        try:
            out, err = p.communicate(timeout=300)
        except Exception:
            p.kill()
            out, err = p.communicate()
        outs.append((p.args[-3:] if p is down else "rebalance", p.returncode, err.strip()[-200:]))
    time.sleep(3)  # a rebalance that waited on the lock would be starting things now
    left = c.processes()
    head_alive = False
    try:
        head_alive = bool(_head(c).get("pid")) and Path(f"/proc/{_head(c)['pid']}").exists()
    except (OSError, ValueError):
        pass
    after = max(c.committed(), default=0)
    res.committed_steps_lost = max(0, before - after)
    if left:
        res.leaks.append(f"processes running after down: {left}")
    if head_alive:
        res.leaks.append("the head runs after down")
    state = json.loads(c.cli("status", "--name", c.name, "--json", check=False).stdout or "{}")
    res.survived = down.returncode == 0 and not left and not head_alive
    res.detail.update(runs=outs, committed_before=before, committed_after=after,
                      status_after=state.get("state"))
    res.notes = (f"down rc {down.returncode}; rebalances rc "
                 f"{[rc for what, rc, _ in outs[1:]]}; {len(left)} processes left")
    return res


def torchft_kill_route(c: Cluster) -> Result:
    """18 (engine torchft): the Lighthouse dashboard's kill route from a client with no
    token: `POST /replica/<id>/kill` for every replica on the status page, over HTTP/1.1
    and HTTP/2, at the head's Lighthouse port. The head's filter refuses each (403 /
    closed); run under `calm`, so any new quorum or failed step after it fails it."""
    from tests.security.torchft_attacks import grpc_call, http1, lighthouse_members

    res = Result("18 torchft Lighthouse kill route", not_applicable=["recover_s"])
    lighthouse = _head(c)["lighthouse"]
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=10) as r:
        replicas = lighthouse_members(r.read().decode())
    answers = {}
    for rid in sorted(replicas):
        a1 = http1(lighthouse, "POST", f"/replica/{rid}/kill")
        a2 = grpc_call(lighthouse, f"/replica/{rid}/kill")
        answers[rid] = {"http1": a1.status or "closed", "http2": a2.status or "closed"}
    res.survived = bool(replicas) and all(
        a == {"http1": "403", "http2": "closed"} for a in answers.values())
    res.committed_steps_lost = 0
    res.steps_replayed = 0
    res.detail.update(victim=None, answers=answers)
    res.notes = f"{len(replicas)} replicas: " + ", ".join(
        f"{k} {v['http1']}/{v['http2']}" for k, v in answers.items())
    return res


def fake_replica(c: Cluster, world: int) -> Result:
    """19 (engine torchft): a fake replica (torchft's own Manager, run by a cluster member:
    tests/security/fake_replica.py) joins the Lighthouse at a very high step, so the real
    replicas are told to heal from it, with a pickle that creates a file when loaded. They
    refuse the heal (spotctl.elastic.peerload); once the fake is killed they train on at
    `world` replicas. Survived: the file never appeared, every replica refused, and no
    replica took the fake's step or restarted."""
    from tests.security.torchft_attacks import run_fake_replica

    from .ft import records

    res = Result("19 torchft fake replica with a pickle", not_applicable=["recover_s"])
    marker = c.root / "fake-payload-ran"
    marker.unlink(missing_ok=True)
    pids = c.worker_pids()
    t0 = time.time()
    refused = run_fake_replica(_head(c)["lighthouse"], marker, c.cluster_dir, world,
                               c.root / "fake-replica.log", dict(os.environ))
    res.detail.update(victim=None, refusals=refused, payload_ran=marker.exists(),
                      seconds_to_refuse=round(time.time() - t0, 1))
    after = c.worker_pids()
    same = all(after.get(n) == p for n, p in pids.items())
    top = max((int(r.get("step") or 0) for r in records(c)), default=0)
    res.survived = refused >= world and not marker.exists() and same and top < 10**6
    res.committed_steps_lost = 0
    res.notes = (f"{refused} refused heals, payload ran: {marker.exists()}, workers kept: "
                 f"{same}")
    return res
