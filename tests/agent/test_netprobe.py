"""The node's network as the agent probes it, and the NCCL transport read from NCCL's own
debug lines (issue 33).

The probe reads fake sysfs trees laid out as the kernel lays them out: a class entry is a
link into /sys/devices, `device` links to the bus device and `device/driver` to the
driver under /sys/bus (paths as on an AWS p4d, a GCP a3/g2 with gVNIC, and this very
machine's virtio NIC)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spotctl.agent import netprobe


def nic(root: Path, cls: str, name: str, pci: str, bus_dev: str | None, driver: str,
        bus: str = "pci") -> None:
    """/sys/class/<cls>/<name> as the kernel makes it. bus_dev: a child device between
    the PCI function and the class device (virtio's `virtio2`), or None."""
    parent = root / "sys/devices/pci0000:00" / pci
    devdir = parent / bus_dev if bus_dev else parent
    node = devdir / cls / name
    node.mkdir(parents=True)
    (root / f"sys/bus/{bus}/drivers/{driver}").mkdir(parents=True, exist_ok=True)
    (root / "sys/class" / cls).mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(node, root / "sys/class" / cls), root / "sys/class" / cls / name)
    os.symlink("../../../" + (bus_dev or pci), node / "device")
    depth = len(devdir.relative_to(root / "sys").parts)
    os.symlink("../" * depth + f"bus/{bus}/drivers/{driver}", devdir / "driver")


def virtual(root: Path, name: str) -> None:
    """lo, docker0, veth: class entries under /sys/devices/virtual, with no `device`."""
    node = root / "sys/devices/virtual/net" / name
    node.mkdir(parents=True)
    (root / "sys/class/net").mkdir(parents=True, exist_ok=True)
    os.symlink(f"../../devices/virtual/net/{name}", root / "sys/class/net" / name)


def touch(root: Path, rel: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"\x7fELF")


def test_plain_virtio_node(tmp_path: Path) -> None:
    # this machine's layout: eth0 -> .../0000:00:03.0/virtio2/net/eth0, driver virtio_net
    virtual(tmp_path, "lo")
    nic(tmp_path, "net", "eth0", "0000:00:03.0", "virtio2", "virtio_net", bus="virtio")
    got = netprobe.probe(tmp_path)
    assert got == {"interfaces": [{"name": "eth0", "kind": "virtio", "driver": "virtio_net"}],
                   "rdma": [], "efa": 0, "libfabric": False, "ofi_nccl": False,
                   "tcpx": False}


def test_plain_ena_node(tmp_path: Path) -> None:
    virtual(tmp_path, "lo")
    nic(tmp_path, "net", "ens5", "0000:00:05.0", None, "ena")
    got = netprobe.probe(tmp_path)
    assert got["interfaces"] == [{"name": "ens5", "kind": "ena", "driver": "ena"}]
    assert (got["efa"], got["libfabric"], got["ofi_nccl"]) == (0, False, False)


def test_efa_node(tmp_path: Path) -> None:
    """A p4d: four EFA interfaces, each an ENA netdev and an EFA RDMA device (rdma-core's
    udev names, rdmapXsY), plus what the EFA installer and the DLAMI put in /opt."""
    virtual(tmp_path, "lo")
    for i, (bus, slot) in enumerate([(16, 27), (32, 27), (144, 27), (160, 27)]):
        nic(tmp_path, "net", f"ens{32 + i}", f"0000:{bus:02x}:{slot - 1:02x}.0", None, "ena")
        nic(tmp_path, "infiniband", f"rdmap{bus}s{slot}", f"0000:{bus:02x}:{slot:02x}.0",
            None, "efa")
    touch(tmp_path, "opt/amazon/efa/lib/libfabric.so.1")
    touch(tmp_path, "opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so")
    got = netprobe.probe(tmp_path)
    assert [i["kind"] for i in got["interfaces"]] == ["ena"] * 4
    assert [d["name"] for d in got["rdma"]] == ["rdmap144s27", "rdmap160s27", "rdmap16s27",
                                                "rdmap32s27"]
    assert {d["kind"] for d in got["rdma"]} == {"efa"}
    assert (got["efa"], got["libfabric"], got["ofi_nccl"], got["tcpx"]) == (4, True, True, False)


def test_efa_named_by_the_older_driver_and_the_older_plugin_path(tmp_path: Path) -> None:
    (tmp_path / "sys/class/infiniband/efa_0").mkdir(parents=True)  # no driver link read
    touch(tmp_path, "opt/aws-ofi-nccl/lib/libnccl-net.so")
    got = netprobe.probe(tmp_path)
    assert got["rdma"] == [{"name": "efa_0", "kind": "efa", "driver": ""}]
    assert (got["efa"], got["ofi_nccl"], got["libfabric"]) == (1, True, False)


def test_gvnic_node(tmp_path: Path) -> None:
    """A GCP GPU VM with gVNIC (driver gve) and a docker bridge (virtual: not listed)."""
    virtual(tmp_path, "lo")
    virtual(tmp_path, "docker0")
    nic(tmp_path, "net", "ens4", "0000:00:04.0", None, "gve")
    nic(tmp_path, "net", "enp6s0", "0000:06:00.0", None, "gve")
    touch(tmp_path, "var/lib/tcpx/lib64/libnccl-net.so")
    got = netprobe.probe(tmp_path)
    assert got["interfaces"] == [{"name": "enp6s0", "kind": "gvnic", "driver": "gve"},
                                 {"name": "ens4", "kind": "gvnic", "driver": "gve"}]
    assert (got["efa"], got["tcpx"]) == (0, True)


def test_a_tree_without_sysfs_is_an_empty_probe(tmp_path: Path) -> None:
    assert netprobe.probe(tmp_path)["interfaces"] == []


PREFIX = "ip-10-0-0-2:4242:4302 [0] "


@pytest.mark.parametrize(("lines", "want"), [
    # NCCL's built-in socket transport
    (["NCCL INFO Bootstrap : Using eth0:10.0.0.2<0>",
      "NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal network plugin.",
      "NCCL INFO NET/IB : No device found.",
      "NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>",
      "NCCL INFO Using network Socket"], "Socket"),
    # InfiniBand
    (["NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.0.0.2<0>",
      "NCCL INFO Using network IB"], "IB"),
    # aws-ofi-nccl on EFA: the provider line comes first, older plugins say AWS Libfabric
    (["NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.7.4-aws",
      "NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)",
      "NCCL INFO Using network AWS Libfabric"], "AWS Libfabric (efa)"),
    (["NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)",
      "NCCL INFO NET/OFI NIC group 0 device #0 0000:56:00.0",
      "NCCL INFO Using network Libfabric"], "Libfabric (efa)"),
    # GCP GPUDirect-TCPX: the plugin names itself before NCCL says which network
    (["NCCL INFO NET/GPUDirectTCPX ver. 3.1.1.",
      "NCCL INFO Using network GPUDirectTCPX"], "GPUDirectTCPX"),
    (["NCCL INFO NET/GPUDirectTCPX ver. 3.1.8.",
      "NCCL INFO NET/GPUDirectTCPX : GPUDirectTCPX enable: 1"], "GPUDirectTCPX"),
    (["NCCL INFO NET/GPUDirectTCPX : GPUDirectTCPX enable: 1",
      "NCCL INFO Using network GPUDirectTCPX_v7"], "GPUDirectTCPX"),
    # nothing names a transport yet (the communicator is not made)
    (["NCCL INFO cudaDriverVersion 12040", "NCCL version 2.21.5+cuda12.4"], None),
    # the plugin failed and NCCL fell back: what it uses is what counts
    (["NCCL WARN NET/OFI Could not find any optimal provider",
      "NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>",
      "NCCL INFO Using network Socket"], "Socket"),
])
def test_nccl_transport(lines: list[str], want: str | None) -> None:
    assert netprobe.nccl_transport(PREFIX + x for x in lines) == want


def test_the_first_communicator_decides() -> None:
    lines = [PREFIX + "NCCL INFO Using network IB", PREFIX + "NCCL INFO Using network Socket"]
    assert netprobe.nccl_transport(lines) == "IB"


def test_transport_from_the_workers_debug_files(tmp_path: Path) -> None:
    (tmp_path / "nccl-host-11.log").write_text(
        PREFIX + "NCCL INFO Bootstrap : Using eth0:10.0.0.2<0>\n")
    (tmp_path / "nccl-host-12.log").write_text(
        PREFIX + "NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>\n"
        + PREFIX + "NCCL INFO Using network Socket\n")
    assert netprobe.nccl_transport_in(tmp_path) == "Socket"


def test_debug_files_are_read_bounded_and_never_through_links(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere.txt"
    secret.write_text(PREFIX + "NCCL INFO Using network IB\n")
    (tmp_path / "w").mkdir()
    os.symlink(secret, tmp_path / "w/nccl-host-1.log")
    os.mkfifo(tmp_path / "w/nccl-host-2.log")  # a FIFO must not block the agent
    big = tmp_path / "w/nccl-host-3.log"
    big.write_text("x" * netprobe.MAX_NCCL_BYTES + "\n" + PREFIX + "NCCL INFO Using network IB\n")
    assert netprobe.nccl_transport_in(tmp_path / "w") is None


def test_nccl_env_keeps_what_the_user_set(tmp_path: Path) -> None:
    got = netprobe.nccl_env({}, tmp_path)
    assert got == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                   "NCCL_DEBUG_FILE": str(tmp_path / "nccl-%h-%p.log")}
    user = {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "ALL", "NCCL_DEBUG_FILE": "/x/n.log"}
    assert netprobe.nccl_env(user, tmp_path) == {}


def test_a_file_is_read_again_only_once_it_grew(tmp_path: Path) -> None:
    f = tmp_path / "nccl-host-7.log"
    f.write_text(PREFIX + "NCCL INFO Bootstrap : Using eth0:10.0.0.2<0>\n")
    seen: dict[str, int] = {}
    assert netprobe.nccl_transport_in(tmp_path, seen) is None
    assert seen == {"nccl-host-7.log": f.stat().st_size}
    with f.open("a") as out:
        out.write(PREFIX + "NCCL INFO Using network IB\n")
    assert netprobe.nccl_transport_in(tmp_path, seen) == "IB"
    assert netprobe.nccl_transport_in(tmp_path, seen) is None  # unchanged: not read
    assert netprobe.nccl_transport_in(tmp_path) == "IB"


def _p4d_software(root: Path, plugin: str = "opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so") -> None:
    touch(root, "opt/amazon/efa/lib/libfabric.so.1")
    touch(root, plugin)


def test_an_efa_node_points_nccl_at_the_ofi_plugin(tmp_path: Path) -> None:
    """Started by systemd, not a login shell, the workers would not have the AMI's library
    path: NCCL would find no net plugin and fall back to sockets on EFA. They get the
    plugin by its path and its libraries' directories first on the library path."""
    _p4d_software(tmp_path)
    net = {"efa": 4}
    got = netprobe.efa_env({"LD_LIBRARY_PATH": "/usr/local/cuda/lib64"}, net, tmp_path)
    assert got == {"NCCL_NET_PLUGIN": "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so",
                   "LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:"
                                      "/usr/local/cuda/lib64"}
    # what the user set stays; a directory already on the path is not added again
    user = {"NCCL_NET_PLUGIN": "/mine/libnccl-net.so",
            "LD_LIBRARY_PATH": "/opt/amazon/efa/lib:/opt/amazon/ofi-nccl/lib"}
    assert netprobe.efa_env(user, net, tmp_path) == {}
    # no EFA device (a g5 on the same AMI), no probe, or no plugin: nothing
    assert netprobe.efa_env({}, {"efa": 0}, tmp_path) == {}
    assert netprobe.efa_env({}, None, tmp_path) == {}
    assert netprobe.efa_env({}, net, tmp_path / "empty") == {}


@pytest.mark.parametrize("plugin", ["opt/amazon/aws-ofi-nccl/lib/libnccl-net-aws-ofi.so",
                                    "opt/aws-ofi-nccl/lib/libnccl-net.so",
                                    "opt/amazon/ofi-nccl/lib64/libnccl-net.so"])
def test_the_plugin_where_each_release_put_it(tmp_path: Path, plugin: str) -> None:
    _p4d_software(tmp_path, plugin)
    got = netprobe.efa_env({}, {"efa": 1}, tmp_path)
    assert got["NCCL_NET_PLUGIN"] == "/" + plugin
    assert got["LD_LIBRARY_PATH"] == f"/{os.path.dirname(plugin)}:/opt/amazon/efa/lib"
    assert netprobe.probe(tmp_path)["ofi_nccl"] is True


def test_the_zygote_of_an_efa_node_starts_with_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library path is read when a process starts, and the node's workers are forked
    by its zygote: the zygote itself (a real one, started by a real agent) must start with
    it. A node without EFA starts its zygote without."""
    from spotctl.agent.config import AgentConfig
    from spotctl.agent.supervisor import Agent
    from spotctl.head.auth import node_token
    from tests.security.conftest import serve_head

    plugin = tmp_path / "ofi" / "lib" / "libnccl-net-ofi.so"
    touch(tmp_path, "ofi/lib/libnccl-net-ofi.so")
    touch(tmp_path, "efa/lib/libfabric.so.1")
    monkeypatch.setattr(netprobe, "OFI_PLUGIN_DIRS", (str(plugin.parent),))
    monkeypatch.setattr(netprobe, "LIBFABRIC_DIRS", (str(tmp_path / "efa" / "lib"),))
    secret = "s" * 43
    (tmp_path / "head").mkdir()

    def zygote_environ(net: dict[str, object], node: str,
                       env: dict[str, str] | None = None) -> dict[str, str]:
        tok = tmp_path / f"token-{node}"
        tok.write_text(node_token(secret, node))
        tok.chmod(0o600)
        cfg = AgentConfig(cluster="c", node_id=node, head_url=srv.url, store_host="127.0.0.1",
                          store_port=1, token_file=str(tok), workdir=str(tmp_path / node),
                          script=str(tmp_path / "train.py"), nproc_per_node=1,
                          expect_gpus=1, gpu_wait_s=0, env=env or {})
        agent = Agent(cfg)
        agent.net = net
        agent._zygote_socket()
        z = agent.zygote
        assert z is not None
        try:
            raw = Path(f"/proc/{z.pid}/environ").read_bytes()
        finally:
            z.kill()
            z.wait()
        return dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)

    with serve_head(tmp_path / "head", secret) as srv:
        env = zygote_environ({"efa": 4}, "n1")
        assert env["NCCL_NET_PLUGIN"] == str(plugin)
        assert env["LD_LIBRARY_PATH"].split(":")[:2] == [str(plugin.parent),
                                                         str(tmp_path / "efa" / "lib")]
        env = zygote_environ({"efa": 0}, "n2")
        assert "NCCL_NET_PLUGIN" not in env
        assert str(plugin.parent) not in env.get("LD_LIBRARY_PATH", "")
        # the spec's [train] env too: what a process reads as it starts (the library path,
        # a preload, the CUDA allocator's settings) counts in the zygote, not in a forked
        # worker's os.environ
        mine = {"LD_LIBRARY_PATH": "/opt/mine/lib", "LD_PRELOAD": "/opt/mine/libx.so",
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        env = zygote_environ({"efa": 0}, "n3", mine)
        assert {k: env.get(k) for k in mine} == mine, env
