"""The torchft engine on the remote providers: what the cloud head and agents are told
(spotctl.remote.bootstrap.CloudNodes), the ssh provider's reverse forward of the head's
Lighthouse (spotctl.remote.revtunnel, a real sshd on loopback and a real Lighthouse), and
`up --provider ssh` with engine torchft end to end over those forwards."""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from spotctl.errors import BootstrapError
from spotctl.providers.base import Instance, ProviderContext
from spotctl.remote import revtunnel
from spotctl.remote.bootstrap import LIGHTHOUSE_PORT, CloudNodes
from spotctl.spec import ClusterSpec
from spotctl.state import Store
from tests.conftest import (
    CliProject,
    kill_procs_mentioning,
    lighthouse_status,
    procs_mentioning,
    remote_worker_reports,
    use_torchft,
    wait_until,
)

from .conftest import SshdFactory

HAVE_FT = importlib.util.find_spec("torchft") is not None
needs_ft = pytest.mark.skipif(not HAVE_FT, reason="torchft is not installed (the 'ft' extra)")


def _nodes(home: Path, engine: str, options: dict | None = None) -> CloudNodes:
    spec = ClusterSpec.model_validate({
        "name": "ft", "provider": "aws", "train": {"engine": engine},
        "aws": {"region": "us-east-1", "ssh_cidr": "198.51.100.7/32"},
    })  # fmt: skip
    ctx = ProviderContext("ft", spec, Store(home).cluster_dir("ft").ensure(), options or {})
    return CloudNodes(ctx, metadata="aws", metadata_url="http://169.254.169.254",
                      api_port=7470, store_port=29400)  # fmt: skip


def _vm(id_: str, role: str, address: str) -> Instance:
    return Instance(id=id_, cluster="ft", role=role, zone="us-east-1a", instance_type="g5",
                    gpus=1, state="running", request_id="r", address=address,
                    public_address="203.0.113.9", ssh_user="ubuntu")  # fmt: skip


def test_cloud_head_and_agents_get_the_lighthouse_on_torchft_only(
    spotctl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPOTCTL_HEAD_PORTS", raising=False)
    ft = _nodes(spotctl_home, "torchft")
    head = ft.head_info(_vm("i-head", "head", "10.0.0.5"))
    # the nodes' side of the head (its private address), where the store is
    assert head.lighthouse == f"http://10.0.0.5:{LIGHTHOUSE_PORT}"
    assert head.store_host == "10.0.0.5" and head.tunnel["remote_port"] == 7470
    # the head (API, store, Lighthouse) binds that private address, not every interface,
    # and the controller's SSH forward goes to it
    assert ft.head_listen(head) == "10.0.0.5" and head.tunnel["remote_host"] == "10.0.0.5"
    cfg = ft.agent_config(_vm("i-w1", "worker", "10.0.0.7"), head)
    assert (cfg.engine, cfg.lighthouse) == ("torchft", head.lighthouse)

    plain = _nodes(spotctl_home, "torchrun")
    head = plain.head_info(_vm("i-head", "head", "10.0.0.5"))
    assert head.lighthouse == ""
    cfg = plain.agent_config(_vm("i-w1", "worker", "10.0.0.7"), head)
    assert (cfg.engine, cfg.lighthouse) == ("torchrun", "")


def test_nodes_bootstrapped_together_start_together_on_torchft(spotctl_home: Path) -> None:
    """Their replicas' first quorum waits for the nodes launched with them (the agent's
    env for the workers), on torchft only, and not for a lone replacement."""
    from spotctl.remote.bootstrap import start_together

    ft = _nodes(spotctl_home, "torchft")
    head = ft.head_info(_vm("i-head", "head", "10.0.0.5"))
    cfg = ft.agent_config(_vm("i-w1", "worker", "10.0.0.7"), head)
    assert start_together(cfg, 4).env["SPOTCTL_FT_START_REPLICAS"] == "4"
    assert "SPOTCTL_FT_START_REPLICAS" not in start_together(cfg, 1).env
    plain = _nodes(spotctl_home, "torchrun")
    cfg = plain.agent_config(_vm("i-w1", "worker", "10.0.0.7"), head)
    assert "SPOTCTL_FT_START_REPLICAS" not in start_together(cfg, 4).env


def test_lighthouse_port_from_options_or_the_test_seam(
    spotctl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTCTL_HEAD_PORTS", "4001:4002:4003")
    n = _nodes(spotctl_home, "torchft")
    assert (n.api_port, n.store_port, n.lighthouse_port) == (4001, 4002, 4003)
    monkeypatch.setenv("SPOTCTL_HEAD_PORTS", "4001:4002")  # the two-port form still works
    assert _nodes(spotctl_home, "torchft").lighthouse_port == LIGHTHOUSE_PORT
    assert _nodes(spotctl_home, "torchft", {"head_lighthouse_port": 4100}).lighthouse_port == 4100
    monkeypatch.setenv("SPOTCTL_HEAD_PORTS", "4001:4002:x")
    with pytest.raises(BootstrapError, match="API:STORE\\[:LIGHTHOUSE\\]"):
        _nodes(spotctl_home, "torchft")


@pytest.mark.ssh
@pytest.mark.slow  # over 4 s: out of the fast set
@needs_ft
def test_reverse_tunnel_forwards_the_lighthouse(
    sshd_factory: SshdFactory, client_key: Path, tmp_path: Path
) -> None:
    from spotctl.head.lighthouse import Lighthouse

    s = sshd_factory.start()
    lh = Lighthouse("127.0.0.1")
    spec = revtunnel.TunnelSpec(
        name="n1", address="127.0.0.1", port=s.port, user="root", key_file=str(client_key),
        known_hosts=str(tmp_path / "known_hosts"), local_api=1, local_store=2,
        local_lighthouse=lh.port,
    )  # fmt: skip
    base = tmp_path / "tunnels"
    try:
        ports = revtunnel.ensure_ports(base, spec)
        assert ports.lighthouse not in (0, lh.port, ports.api, ports.store)
        # the Lighthouse answers on the host's loopback end of the forward
        assert "quorum" in lighthouse_status(f"http://127.0.0.1:{ports.lighthouse}")
        assert revtunnel.ensure_ports(base, spec) == ports  # reused while alive
        assert revtunnel.ensure(base, spec) == (ports.api, ports.store)
    finally:
        revtunnel.stop(base, "n1")
        lh.stop()


class FtProject(CliProject):
    remote: Path
    nodes: list[str]
    started: dict[str, Any]  # `status --json` once both nodes' workers are past step 5

    def debug(self) -> str:
        r = self.remote
        return "\n".join(
            f"--- {p.relative_to(r)}\n{p.read_text(errors='replace')[-1500:]}"
            for p in sorted(r.glob(f"{self.name}/*/*.log"))
            + sorted(r.glob(f"{self.name}/*/work/*.log"))
        )

    def report(self, node: str) -> dict[str, Any]:
        """The node's rank-0 worker's own status report."""
        return remote_worker_reports(self.remote, self.name)[node]


def over_sshd(test: Callable[..., None]) -> Callable[..., None]:
    """The marks of a test that runs a cluster over real sshd (slow: real torchrun and
    torchft)."""
    for mark in (needs_ft, pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.e2e,
                 pytest.mark.ssh):  # fmt: skip
        test = mark(test)
    return test


@contextmanager
def two_ssh_hosts(sshd_factory: SshdFactory, client_key: Path, tmp_path: Path, name: str,
                  train: str = "") -> Iterator[FtProject]:  # fmt: skip
    """An ssh-provider project on engine torchft with two hosts (two sshd on loopback)
    reached through reverse tunnels, `train` added to its [train] table, `up` and a world
    of 2 past step 5. Each host's notice is the file `tmp_path/notice-<node>`.
    Afterwards: `down`, and no process of the cluster left."""
    a, b = sshd_factory.start(), sshd_factory.start()
    remote = tmp_path / "remote"
    proj = FtProject(tmp_path, name, {"SPOTCTL_SSH_REMOTE_ROOT": str(remote),
                                     "SPOTCTL_SSH_TUNNEL": "always"})  # fmt: skip
    proj.remote = remote
    (proj.project / "spotctl.toml").write_text(
        f'name = "{name}"\nprovider = "ssh"\ngpus = "2"\n\n'
        f'[train]\nscript = "train.py"\ncheckpoint_every = 5\npython = "{sys.executable}"\n'
        + train
        + 'env = { TRAIN_STEP_SLEEP_S = "0.05", TRAIN_DATASET_SIZE = "4096" }\n\n'
        + '[ssh]\ndedicated_hosts = true\n\n'
        + "".join(
            f'[[ssh.hosts]]\naddress = "127.0.0.1"\nport = {s.port}\nkey = "{client_key}"\n'
            f'notice_file = "{tmp_path}/notice-ssh-127-0-0-1-{s.port}"\n\n'
            for s in (a, b)
        )
    )
    use_torchft(proj)
    proj.nodes = [f"ssh-127-0-0-1-{a.port}", f"ssh-127-0-0-1-{b.port}"]
    home = proj.home
    try:
        proj.cli("up", "--wait", "180", timeout=400)
        proj.started = proj.wait_for(
            "a world of 2 past step 5",
            lambda st: st.get("world_size") == 2 and (st.get("step") or 0) >= 5,
            timeout=180, interval=1)  # fmt: skip
        yield proj
        proj.cli("down", "--name", name, "--yes", timeout=240)
        wait_until(lambda: not procs_mentioning(remote) and not procs_mentioning(home), 60,
                   "the cluster's processes to end", 0.5,
                   lambda: f"left: {procs_mentioning(remote) + procs_mentioning(home)}")  # fmt: skip
    finally:
        if (home / "state.db").exists():
            proj.cli("down", "--name", name, "--yes", check=False)
        kill_procs_mentioning(remote)
        kill_procs_mentioning(home)


@over_sshd
def test_up_torchft_over_reverse_tunnels_on_two_ssh_hosts(
    sshd_factory: SshdFactory, client_key: Path, tmp_path: Path
) -> None:
    """`up --provider ssh` with engine torchft and two hosts reached through reverse
    tunnels (forced on loopback): each agent is configured with the head's Lighthouse at
    its own host-side forward, both replicas train in one quorum there, `down` ends all."""
    with two_ssh_hosts(sshd_factory, client_key, tmp_path, "ftb") as proj:
        remote, home, nodes = proj.remote, proj.home, proj.nodes
        head = json.loads((home / "clusters" / "ftb" / "head" / "head.json").read_text())
        head_port = int(head["lighthouse"].rsplit(":", 1)[1])
        seen = []
        for n in nodes:
            cfg = json.loads((remote / "ftb" / n / "agent.json").read_text())
            assert cfg["engine"] == "torchft", cfg
            host, _, port = cfg["lighthouse"].removeprefix("http://").partition(":")
            # the host's own loopback end of its forward, not the controller's port
            assert host == "127.0.0.1" and int(port) != head_port, cfg
            seen.append(int(port))
            page = lighthouse_status(cfg["lighthouse"])  # the head's Lighthouse answers
            assert all(x in page for x in nodes), page
        assert len(set(seen)) == 2, seen
        token = (home / "clusters" / "ftb" / "token").read_text().strip()
        req = urllib.request.Request(head["url"] + "/api/status",
                                     headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.load(r)["engine"] == "torchft"


@over_sshd
def test_one_replica_group_spans_two_ssh_hosts_and_a_notice_on_the_second_takes_it_out(
    sshd_factory: SshdFactory, client_key: Path, tmp_path: Path
) -> None:
    """`[train] nodes_per_replica = 2` on the ssh provider: two hosts (two sshd on
    loopback, each behind its reverse forward of the head) make one replica group under
    one torchrun. The workers' own reports: ranks 0 and 1 of a world of 2, one replica,
    the same Manager address, steps advancing with the same worker pids; the head puts
    both nodes in one group. (Both hosts are this machine's loopback, so the group's
    Manager is on loopback with no filter, as a one-node group's:
    tests/e2e/test_network_partition.py -k span covers the filter across real links.)

    Then, on the same cluster (one bring-up for both parts), a notice on the group's
    second host (its notice file appears; the group's Manager is on the first): judged by
    the workers' own reports, both hosts' workers drain after the same committed step, as
    the processes that trained before; the journal has the notice from that host's file
    and its leave; the first host waits for a replacement; `down` ends every process."""
    with two_ssh_hosts(sshd_factory, client_key, tmp_path, "ftg",
                       "nodes_per_replica = 2\n") as proj:  # fmt: skip
        nodes = proj.nodes
        groups = {n["id"]: n.get("group") for n in proj.started["nodes"]}
        assert set(groups) == set(nodes) and len(set(groups.values())) == 1, groups
        reports = {n: proj.report(n) for n in nodes}
        assert sorted(r["rank"] for r in reports.values()) == [0, 1], reports
        assert all(r["replicas"] == 1 and r["world_size"] == 2 for r in reports.values()), reports
        assert len({r["manager"] for r in reports.values()}) == 1, reports
        wait_until(lambda: all(proj.report(n)["step"] >= reports[n]["step"] + 5 for n in nodes),
                   120, "both nodes' workers to go on", 0.5, proj.debug)  # fmt: skip
        pids = {n: proj.report(n)["pid"] for n in nodes}
        assert pids == {n: r["pid"] for n, r in reports.items()}, "a worker restarted"

        # the notice on the second host
        first, second = sorted(nodes, key=lambda n: reports[n]["rank"])
        n0 = len(proj.events())
        (tmp_path / f"notice-{second}").write_text("")

        def drained() -> dict[str, dict[str, Any]] | None:
            now = {n: proj.report(n) for n in nodes}
            return now if all(r["phase"] == "drained" for r in now.values()) else None

        left = wait_until(drained, 90, "both hosts' workers to drain", 0.5, proj.debug)
        assert {n: r["pid"] for n, r in left.items()} == pids, (left, pids)
        step = left[second]["drain_step"]
        assert step > 0 and left[first]["drain_step"] == step, left
        assert all(r["step"] == step for r in left.values()), left  # left where committed
        # the journal: the notice from the host's file and that host's leave (no world
        # trains after it here, so no rescale is journaled)
        def journaled() -> list[dict[str, Any]] | None:
            e = proj.events()[n0:]
            return e if any(x["type"] == "leave" and x.get("node") == second for x in e) else None

        evs = wait_until(journaled, 60, "the leave in the journal", 0.5,
                         lambda: json.dumps(proj.events()[-10:]))
        [notice] = [e for e in evs if e["type"] == "notice"]
        assert (notice["node"], notice["source"]) == (second, "file"), notice
        # the partner waits for a replacement (its agent's own log), not finished: the
        # agent says so once its torchrun has exited, which may come after the journal's
        # leave
        agent_log = proj.remote / "ftg" / first / "agent.log"
        wait_until(lambda: "left the quorum" in agent_log.read_text(), 60,
                   "the first host's agent to see its group leave", 0.5,
                   lambda: agent_log.read_text()[-2000:])
        log = agent_log.read_text()
        assert "left the quorum" in log and "training finished" not in log, log[-2000:]


@pytest.mark.slow  # builds spotctl's wheel and repacks its dependencies
@needs_ft
def test_torchft_is_shipped_to_the_nodes_on_torchft_only(
    spotctl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPOTCTL_HEAD_PORTS", raising=False)
    ft, _ = _nodes(spotctl_home, "torchft", {"deliver": True}).package()
    plain, _ = _nodes(spotctl_home, "torchrun", {"deliver": True}).package()
    assert ft is not None and plain is not None
    assert "torchft==" in ft.requirements
    assert "torchft" not in plain.requirements
