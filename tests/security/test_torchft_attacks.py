"""torchft's listeners on a real local cluster (engine torchft, 2 nodes), attacked by a
client with no token and no torchft client, judged by the workers' own step logs (pid
and step of every committed step), not by the head's view:

- the head's Lighthouse port: torchft 0.2.0 serves its dashboard there, and its
  `POST /replica/<id>/kill` (over HTTP/1.1 or HTTP/2, or smuggled behind `GET /status`
  after a header value's LF LF, issue 60) made the Lighthouse call that replica's
  Manager `Kill` RPC, which exits the worker. The head's filter
  (spotctl.head.grpc_filter) passes only the Lighthouse's gRPC methods and its status
  page: every replica keeps its worker and trains on in the same quorum.
- a replica's Manager: torchft has no way not to serve its `Kill` RPC. A one-node
  group's Manager binds the node's loopback (here all nodes share the machine's; that it
  is closed to the cluster network is tests/e2e/test_network_partition.py -k torchft),
  so what can call it is a process of the node (the documented limit,
  docs/security.md). What it gets: that one replica's worker exits; the other replica
  trains on without a restart (the hot path).
- a fake replica (tests/security/fake_replica.py: torchft's own Manager, run by a cluster
  member) joins the Lighthouse at a very high step, so the real replicas heal from it, and
  its state carries a pickle that runs a command when loaded. Before spotctl.elastic
  loaded heal metadata with its own loader (spotctl.elastic.peerload) the command ran in
  every replica; now each refuses the heal, and once the fake is gone the replicas train
  on from where they were, never at its step."""

from __future__ import annotations

import importlib.util
import json
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    LocalCluster,
    last_step,
    node_steps,
    send_and_read,
    up_ft_train,
    wait_until,
)
from tests.security.torchft_attacks import (
    grpc_call,
    http1,
    kill_request,
    lighthouse_members,
    run_fake_replica,
)

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NODES = ("n1", "n2")


@pytest.fixture(scope="module")
def ft_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """One 2-node torchft cluster for both tests, in this order: the fake replica's (its
    check: every step once from step 1 by the workers started with the cluster), then the
    kill routes' (the Kill RPC of its part (b) ends one replica's worker). `down` at the
    end, as each test did; a cluster of its own each cost one more start."""
    c = LocalCluster(tmp_path_factory.mktemp("ft") / "ftk", "ftk")
    try:
        logs = up_ft_train(c, 2)
        yield c, logs
        c.cli("down", "--name", "ftk", "--yes")
    finally:
        c.teardown()


def test_a_fake_replica_runs_no_code_in_the_replicas_it_heals(
        ft_cluster: tuple[Any, Path]) -> None:
    c, logs = ft_cluster
    lighthouse = json.loads((c.cluster_dir / "head" / "head.json").read_text())["lighthouse"]
    marker = c.tmp / "payload-ran"
    out = c.tmp / "fake.log"
    # the real replicas are told to heal from it, and refuse what it sends
    refused = run_fake_replica(lighthouse, marker, c.cluster_dir, 2, out, c.env)
    assert refused >= 2 or marker.exists(), out.read_text(errors="replace")[-3000:] + c.debug()
    assert not marker.exists(), "the fake replica's payload ran in a replica"
    pids = {n: node_steps(logs, n)[0]["pid"] for n in NODES}
    marks = {n: last_step(logs, n) for n in NODES}
    wait_until(lambda: all(last_step(logs, n) >= marks[n] + 10 for n in NODES), 180,
               "both replicas 10 steps past the fake's exit", 0.5, c.debug)
    for n in NODES:  # every step once, in order, by the worker started with the cluster
        rows = node_steps(logs, n)
        steps = [s["step"] for s in rows]
        assert steps == list(range(1, len(steps) + 1)), (n, steps)  # never the fake's step
        assert {s["pid"] for s in rows} == {pids[n]}, f"{n}'s worker was restarted"
    assert not marker.exists()


def test_torchft_kill_routes(ft_cluster: tuple[Any, Path]) -> None:
    """(after the fake replica's test, on the same cluster: its part (b) ends a worker)"""
    c, logs = ft_cluster
    lighthouse = json.loads((c.cluster_dir / "head" / "head.json").read_text())["lighthouse"]
    assert lighthouse

    def members() -> dict[str, str] | None:
        with urllib.request.urlopen(f"{lighthouse}/status", timeout=10) as r:
            m = lighthouse_members(r.read().decode())
        return m if len(m) == 2 else None

    # the status page stays readable: it names every replica and its Manager's address
    found = wait_until(members, 60, "both replicas on the Lighthouse's status page", 0.5)
    assert found is not None
    pids = {n: node_steps(logs, n)[-1]["pid"] for n in NODES}
    marks = {n: last_step(logs, n) for n in NODES}

    # (a) the dashboard's kill route on the head's Lighthouse port, both protocols
    answers = []
    smuggled = []
    host, port = urllib.parse.urlsplit(lighthouse).hostname, urllib.parse.urlsplit(lighthouse).port
    assert host and port
    for rid in found:
        answers.append(http1(lighthouse, "POST", f"/replica/{rid}/kill"))
        answers.append(grpc_call(lighthouse, f"/replica/{rid}/kill"))
        # (issue 60) the kill behind the status page, after a header value's LF LF
        smuggled.append(send_and_read(host, port, (
            f"GET /status HTTP/1.1\r\nHost: h\r\nX-A: a\n\nPOST /replica/{rid}/kill "
            f"HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n").encode()))
    wait_until(lambda: all(last_step(logs, n) >= marks[n] + 30 for n in NODES), 180,
               "both replicas 30 steps past the kill requests", 0.5, c.debug)
    for n in NODES:
        after = [s for s in node_steps(logs, n) if s["step"] > marks[n]]
        steps = [s["step"] for s in after]
        assert steps == list(range(marks[n] + 1, marks[n] + 1 + len(steps))), (n, steps)
        assert {s["pid"] for s in after} == {pids[n]}, f"{n}'s worker was restarted"
        assert {s["replicas"] for s in after} == {2}, f"{n} left the quorum"
    assert [a.status for a in answers[0::2]] == ["403", "403"], answers
    assert all(a.startswith(b"HTTP/1.1 403") and a.count(b"HTTP/1.") == 1 for a in smuggled), \
        smuggled
    assert all(a.closed for a in answers[1::2]), answers

    # (b) the documented limit: a Manager's Kill RPC, from a process of its node
    victim_id, victim_addr = sorted(found.items())[0]
    victim = next(n for n in NODES if victim_id.startswith(n))
    other = next(n for n in NODES if n != victim)
    grpc_call(victim_addr, "/torchft.ManagerService/Kill", kill_request())
    wait_until(lambda: _proc_gone(pids[victim]), 30, f"{victim}'s worker to exit", 0.2, c.debug)
    o0 = last_step(logs, other)
    wait_until(lambda: last_step(logs, other) >= o0 + 20, 180, f"{other} 20 steps past the kill",
               0.5, c.debug)
    assert {s["pid"] for s in node_steps(logs, other)} == {pids[other]}, \
        f"{other}'s worker was restarted by another replica's kill"


def _proc_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
