"""What a node reports about its network (issue 33): the agent's probe and the transport
its workers' NCCL named reach the head in a heartbeat, and `status --json` shows them per
node. The head believes only a bounded, well-formed report: it answers 400 to anything
else and keeps what it had. A real HeadServer on loopback, the real agent and client."""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotctl.agent import netprobe
from spotctl.agent.config import AgentConfig
from spotctl.agent.supervisor import Agent
from spotctl.head.auth import node_token
from spotctl.head.server import HeadServer
from spotctl.spec import ClusterSpec
from spotctl.state import NodeRow, Store
from tests.agent.test_netprobe import PREFIX, nic, touch, virtual
from tests.security.conftest import serve_head

SECRET = secrets.token_urlsafe(32)


@pytest.fixture
def head(tmp_path: Path) -> Iterator[HeadServer]:
    (tmp_path / "head").mkdir()
    with serve_head(tmp_path / "head", SECRET) as srv:
        yield srv


def beat(head: HeadServer, nid: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    body = {"node_id": nid, "agent_state": "waiting", "workers": [], **extra}
    req = urllib.request.Request(head.url + "/api/heartbeat", data=json.dumps(body).encode(),
                                 method="POST")
    req.add_header("Authorization", f"Bearer {node_token(SECRET, nid)}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def good_net() -> dict[str, Any]:
    return {"interfaces": [{"name": "ens32", "kind": "ena", "driver": "ena"}],
            "rdma": [{"name": "rdmap16s27", "kind": "efa", "driver": "efa"}], "efa": 1,
            "libfabric": True, "ofi_nccl": True, "tcpx": False, "nccl_transport": None}


def many(n: int) -> list[dict[str, str]]:
    return [{"name": f"eth{i}", "kind": "ena", "driver": "ena"} for i in range(n)]


@pytest.mark.parametrize(("net", "why"), [
    ("efa", "net must be an object"),
    ({"interfaces": many(65)}, "net.interfaces must be a list of at most 64"),
    ({"rdma": many(65)}, "net.rdma must be a list of at most 64"),
    ({"interfaces": [{"name": "e" * 33, "kind": "ena"}]}, "net.interfaces[0].name"),
    ({"interfaces": [{"name": "eth0", "kind": "x" * 10_000}]}, "net.interfaces[0].kind"),
    ({"interfaces": [{"name": "eth0", "blob": "x"}]}, "net.interfaces[0] must be an object"),
    ({"interfaces": ["eth0"]}, "net.interfaces[0] must be an object"),
    ({"interfaces": [{"name": "eth0\n"}]}, "net.interfaces[0].name"),
    ({"efa": 1 << 40}, "net.efa must be an integer"),
    ({"efa": True}, "net.efa must be an integer"),
    ({"ofi_nccl": "yes"}, "net.ofi_nccl must be true or false"),
    ({"nccl_transport": "S" * 65}, "net.nccl_transport"),
    ({"nccl_transport": ["IB"]}, "net.nccl_transport"),
    ({"extra": "x" * 100_000}, "unexpected field 'extra'"),
])
def test_the_head_refuses_a_bad_network_report_and_keeps_the_good_one(
        head: HeadServer, net: Any, why: str) -> None:
    assert beat(head, "n1", net=good_net())[0] == 200
    code, body = beat(head, "n1", net=net)
    assert code == 400 and why in body["error"], body
    # the first report still stands, the bad one changed nothing
    assert head.coord.status()["nodes"]["n1"]["net"] == good_net()


def test_a_beat_without_the_report_keeps_it(head: HeadServer) -> None:
    assert beat(head, "n1", net=good_net())[0] == 200
    assert beat(head, "n1")[0] == 200
    assert head.coord.status()["nodes"]["n1"]["net"]["efa"] == 1


class Recording:
    """The agent's real HeadClient, with each heartbeat body kept for the test to read."""

    def __init__(self, client: Any):
        self.client = client
        self.bodies: list[dict[str, Any]] = []

    def __getattr__(self, k: str) -> Any:
        return getattr(self.client, k)

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        return self.client.heartbeat(body)  # type: ignore[no-any-return]


def agent_for(tmp_path: Path, head: HeadServer, nid: str, gpus: int) -> Agent:
    tok = tmp_path / f"{nid}.token"
    tok.write_text(node_token(SECRET, nid))
    cfg = AgentConfig(cluster="c1", node_id=nid, head_url=head.url, store_host="127.0.0.1",
                      store_port=1, token_file=str(tok), workdir=str(tmp_path / nid),
                      script=str(tmp_path / "train.py"), expect_gpus=gpus)
    a = Agent(cfg)
    a.head = Recording(a.head)  # type: ignore[assignment]
    return a


def test_status_json_shows_what_each_node_has(tmp_path: Path, head: HeadServer,
                                              run_cli: Any) -> None:
    # an EFA GPU node whose workers' NCCL picked aws-ofi-nccl, and a plain CPU node
    efa_root, cpu_root = tmp_path / "efa-root", tmp_path / "cpu-root"
    nic(efa_root, "net", "ens32", "0000:10:1a.0", None, "ena")
    nic(efa_root, "infiniband", "rdmap16s27", "0000:10:1b.0", None, "efa")
    touch(efa_root, "opt/amazon/efa/lib/libfabric.so.1")
    touch(efa_root, "opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so")
    virtual(cpu_root, "lo")
    nic(cpu_root, "net", "eth0", "0000:00:03.0", "virtio2", "virtio_net", bus="virtio")

    gpu = agent_for(tmp_path, head, "gpu-1", gpus=8)
    cpu = agent_for(tmp_path, head, "cpu-1", gpus=0)
    gpu.net, cpu.net = netprobe.probe(efa_root), netprobe.probe(cpu_root)
    for a in (gpu, cpu):
        for _ in range(3):
            assert a._heartbeat([]) is not None
    # sent until the head that answers has it, then no more
    assert ["net" in b for b in gpu.head.bodies] == [True, True, False]  # type: ignore[attr-defined]
    # the workers' first communicator names the transport: the next beat carries it
    (gpu.status_dir / "nccl-gpu-1-4242.log").write_text(
        PREFIX + "NCCL INFO NET/OFI Selected Provider is efa (found 1 nics)\n"
        + PREFIX + "NCCL INFO Using network AWS Libfabric\n")
    gpu._watch_nccl()
    gpu._heartbeat([])
    assert gpu.head.bodies[-1]["net"]["nccl_transport"] == "AWS Libfabric (efa)"  # type: ignore[attr-defined]

    store = Store()
    store.upsert_cluster("c1", "local", ClusterSpec.model_validate({"name": "c1"}).model_dump(),
                         "up")
    store.set_head("c1", {"url": head.url})
    store.cluster_dir("c1").path.mkdir(parents=True, exist_ok=True)
    store.cluster_dir("c1").token_file.write_text(SECRET)
    for nid in ("gpu-1", "cpu-1"):
        store.upsert_node(NodeRow(nid, "c1", "local", "local-a", "local", 0, "running", 0.0, 0.0,
                                  time.time(), None, "r", "127.0.0.1"))
    res = run_cli("status", "--name", "c1", "--json")
    assert res.exit_code == 0, res.output
    nodes = {n["id"]: n for n in json.loads(res.stdout)["nodes"]}
    assert nodes["gpu-1"]["nccl_transport"] == "AWS Libfabric (efa)"
    assert nodes["gpu-1"]["net"]["efa"] == 1 and nodes["gpu-1"]["net"]["ofi_nccl"] is True
    assert nodes["gpu-1"]["net"]["rdma"] == [{"name": "rdmap16s27", "kind": "efa",
                                              "driver": "efa"}]
    assert nodes["cpu-1"]["nccl_transport"] == "gloo"
    assert nodes["cpu-1"]["net"]["interfaces"] == [{"name": "eth0", "kind": "virtio",
                                                    "driver": "virtio_net"}]
    # the table says the same in its last column
    res = run_cli("status", "--name", "c1")
    assert res.exit_code == 0, res.output
    rows = {x.split()[0]: x.split()[-1] for x in res.stdout.splitlines() if x.split()}
    assert rows["cpu-1"] == "gloo" and rows["gpu-1"] == "(efa)", res.stdout


def test_a_restarted_head_gets_the_report_again(tmp_path: Path, head: HeadServer) -> None:
    """A new head (its own head_id, no memory of the node) is told on the beat after it
    first answers; a head that has it is not told again."""
    from spotctl.head.client import HeadClient

    a = agent_for(tmp_path, head, "n1", gpus=0)
    a.net = good_net()
    for _ in range(3):
        a._heartbeat([])
    assert head.coord.status()["nodes"]["n1"]["net"]["efa"] == 1
    (tmp_path / "head2").mkdir()
    with serve_head(tmp_path / "head2", SECRET) as again:
        a.head.client = HeadClient(again.url, a.head.token, timeout_s=2.0)  # type: ignore[attr-defined]
        a._heartbeat([])  # the new head answers with its own id: not told yet
        assert again.coord.status()["nodes"]["n1"]["net"] is None
        a._heartbeat([])
        assert again.coord.status()["nodes"]["n1"]["net"]["efa"] == 1
        a._heartbeat([])
    assert ["net" in b for b in a.head.bodies] == [  # type: ignore[attr-defined]
        True, True, False, False, True, False]
