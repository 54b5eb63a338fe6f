"""What network a node really has, and which transport NCCL picked on it.

`probe(root)` reads the node's sysfs and a few install paths once, at agent start; `root`
is "/" on a node and a fake tree in tests. The real layouts it models (Linux sysfs, the
AWS EFA installer and the Deep Learning AMI, GCP's a3 images):

- /sys/class/net/<if>/device -> the bus device of a real NIC (absent for lo, veth,
  bridges, ifb: those are skipped); /sys/class/net/<if>/device/driver -> the bound
  driver, whose name says the kind: `ena` (AWS ENA), `gve` (GCP gVNIC), `virtio_net`
  (or, for a virtio-pci parent, `virtio-pci`), `mlx5_core`, ...
- /sys/class/infiniband/<dev> -> RDMA devices; EFA devices are named `efa_N` or, after
  rdma-core's udev rename, `rdmapXsY`, and their device/driver is `efa`.
- /opt/amazon/efa/lib64 or lib (libfabric.so*, the EFA installer's libfabric with its efa
  provider); /opt/amazon/ofi-nccl/lib*/libnccl-net*.so (aws-ofi-nccl as the EFA installer
  ships it; named libnccl-net-ofi.so, libnccl-net-aws-ofi.so or libnccl-net.so by
  release), /opt/amazon/aws-ofi-nccl/lib or /opt/aws-ofi-nccl/lib (older Deep Learning
  AMIs).
- /var/lib/tcpx and /var/lib/tcpxo (GPUDirect-TCPX/TCPXO's NCCL plugin on GCP a3 nodes).

`nccl_transport(lines)` reads NCCL's own INFO lines (NCCL_DEBUG=INFO,
NCCL_DEBUG_SUBSYS=INIT,NET) as NCCL prints them, e.g.
  `host:123:456 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)`
  `host:123:456 [0] NCCL INFO Using network AWS Libfabric`  (newer plugins: `Libfabric`)
  `host:123:456 [0] NCCL INFO Using network Socket` / `Using network IB`
  `host:123:456 [0] NCCL INFO NET/GPUDirectTCPX ver. 3.1.8.` (GCP a3-high; TCPXO: NET/FasTrak)
and names the transport: "Socket", "IB", "AWS Libfabric (efa)", "GPUDirectTCPX".
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from spotctl.agent import runas

MAX_INTERFACES = 64  # the head refuses more (spotctl.head.validate)
MAX_NCCL_BYTES = 256 * 1024  # of each NCCL debug file: the transport is named at init
MAX_NCCL_FILES = 16
NCCL_FILE_GLOB = "nccl-*.log"
NCCL_FILE_PATTERN = "nccl-%h-%p.log"  # NCCL expands %h (host) and %p (pid)

# driver (basename of device/driver) -> the kind status shows
KINDS = {"ena": "ena", "gve": "gvnic", "virtio_net": "virtio", "virtio-pci": "virtio",
         "efa": "efa", "mlx5_core": "mlx5", "mlx4_core": "mlx4", "ixgbevf": "ixgbevf"}
_NAME = re.compile(r"^[A-Za-z0-9._:@-]{1,32}$")


def _driver(dev: Path) -> str:
    """The driver bound to a sysfs device directory, '' when none."""
    try:
        return os.path.basename(os.readlink(dev / "device" / "driver"))
    except OSError:
        return ""


def _any(root: Path, patterns: Iterable[str]) -> bool:
    return any(glob.glob(str(root / p.lstrip("/"))) for p in patterns)


def probe(root: str | Path = "/") -> dict[str, Any]:
    """The node's interfaces, RDMA devices and fast-network software under `root`."""
    r = Path(root)
    interfaces: list[dict[str, str]] = []
    net = r / "sys/class/net"
    for name in sorted(os.listdir(net)) if net.is_dir() else []:
        d = net / name
        if not (d / "device").exists() or not _NAME.match(name):
            continue  # lo, veth, bridges, ifb: no device of their own
        drv = _driver(d)
        interfaces.append({"name": name, "kind": KINDS.get(drv, drv or "unknown"),
                           "driver": drv})
    rdma: list[dict[str, str]] = []
    ib = r / "sys/class/infiniband"
    for name in sorted(os.listdir(ib)) if ib.is_dir() else []:
        if not _NAME.match(name):
            continue
        drv = _driver(ib / name)
        kind = "efa" if drv == "efa" or name.startswith("efa_") else KINDS.get(drv, drv or "rdma")
        rdma.append({"name": name, "kind": kind, "driver": drv})
    return {
        "interfaces": interfaces[:MAX_INTERFACES],
        "rdma": rdma[:MAX_INTERFACES],
        "efa": sum(1 for x in rdma if x["kind"] == "efa"),
        "libfabric": _libfabric_dir(r) is not None,
        "ofi_nccl": ofi_plugin(r) is not None,
        "tcpx": _any(r, ("/var/lib/tcpx/lib64/libnccl-net*.so",
                         "/var/lib/tcpxo/lib64/libnccl-net*.so")),
    }


# aws-ofi-nccl, NCCL's net plugin for EFA, where the EFA installer and the Deep Learning
# AMIs put it, and the names its releases gave it (newest first)
OFI_PLUGIN_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/amazon/ofi-nccl/lib64",
                   "/opt/amazon/aws-ofi-nccl/lib", "/opt/aws-ofi-nccl/lib")
OFI_PLUGIN_NAMES = ("libnccl-net-ofi.so", "libnccl-net-aws-ofi.so", "libnccl-net.so")
LIBFABRIC_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64")


def _libfabric_dir(root: Path) -> str | None:
    """The EFA installer's libfabric directory on the node, or None."""
    return next((d for d in LIBFABRIC_DIRS if _any(root, (f"{d}/libfabric.so*",))), None)


def ofi_plugin(root: str | Path = "/") -> tuple[str, list[str]] | None:
    """(the aws-ofi-nccl plugin's path on the node, the library directories it needs: its
    own and the EFA installer's libfabric's), or None where it is not installed."""
    r = Path(root)
    plugin = next((f"{d}/{n}" for d in OFI_PLUGIN_DIRS for n in OFI_PLUGIN_NAMES
                   if (r / d.lstrip("/") / n).is_file()), None)  # fmt: skip
    if plugin is None:
        return None
    fabric = _libfabric_dir(r)
    return plugin, [plugin.rsplit("/", 1)[0], *([fabric] if fabric else [])]


def efa_env(environ: dict[str, str], net: dict[str, Any] | None,
            root: str | Path = "/") -> dict[str, str]:
    """What a node with EFA devices gives its workers so that NCCL loads aws-ofi-nccl
    (and through it libfabric's efa provider), none the user set overridden. NCCL looks
    only for libnccl-net.so on the library path unless told otherwise, and a login
    shell's profile, which sets that path on the AMIs, is not what starts the agent: left
    alone, NCCL falls back to TCP sockets on an EFA node (status then names "Socket").
    NCCL_NET_PLUGIN names the plugin by its path; LD_LIBRARY_PATH gets its directory and
    libfabric's (read at process start: the zygote's environment takes it too)."""
    if not net or not net.get("efa"):
        return {}
    found = ofi_plugin(root)
    if found is None:
        return {}
    plugin, dirs = found
    out: dict[str, str] = {}
    if "NCCL_NET_PLUGIN" not in environ:
        out["NCCL_NET_PLUGIN"] = plugin
    have = [p for p in environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    add = [d for d in dirs if d not in have]
    if add:
        out["LD_LIBRARY_PATH"] = ":".join(add + have)
    return out


_USING = re.compile(r"NCCL INFO Using network (\S.*?)\s*$")
_OFI_PROVIDER = re.compile(r"NCCL INFO NET/OFI Selected [Pp]rovider is (\w+)")
_TCPX = re.compile(r"NCCL INFO NET/(GPUDirectTCPX\w*|FasTrak)\b")


def nccl_transport(lines: Iterable[str]) -> str | None:
    """The inter-node transport the first NCCL communicator named, or None."""
    provider = None
    plugin = None
    for line in lines:
        m = _OFI_PROVIDER.search(line)
        if m and provider is None:
            provider = m.group(1)
        m = _TCPX.search(line)
        if m and plugin is None:
            plugin = m.group(1)
        m = _USING.search(line)
        if m:
            # a plugin may name its API version too (`GPUDirectTCPX_v7`)
            name = re.sub(r"_v\d+$", "", m.group(1)[:48])
            if "Libfabric" in name and provider:
                return f"{name} ({provider})"
            return name
    return plugin


def nccl_transport_in(directory: Path, seen: dict[str, int] | None = None) -> str | None:
    """The transport named in the workers' NCCL debug files in `directory` (the newest
    files first: a restarted group writes new ones). With `seen` (file name -> size, kept
    by the caller), a file is read again only once it has grown."""
    files = sorted(directory.glob(NCCL_FILE_GLOB), key=_mtime, reverse=True)
    for p in files[:MAX_NCCL_FILES]:
        if seen is not None:
            size = _size(p)
            if seen.get(p.name) == size:
                continue
            seen[p.name] = size
        raw = runas.read_status(p, MAX_NCCL_BYTES)
        if raw:
            found = nccl_transport(raw.decode("utf-8", "replace").splitlines())
            if found:
                return found
    return None


def _size(p: Path) -> int:
    try:
        return p.lstat().st_size
    except OSError:
        return -1


def _mtime(p: Path) -> float:
    try:
        return p.lstat().st_mtime
    except OSError:
        return 0.0


def nccl_env(environ: dict[str, str], directory: Path) -> dict[str, str]:
    """The NCCL debug settings a CUDA node's workers get, none the user set overridden:
    INFO for the init and network subsystems only, into one file per worker process."""
    out: dict[str, str] = {}
    if "NCCL_DEBUG" not in environ:
        out["NCCL_DEBUG"] = "INFO"
    if "NCCL_DEBUG_SUBSYS" not in environ:
        out["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    if "NCCL_DEBUG_FILE" not in environ:
        out["NCCL_DEBUG_FILE"] = str(directory / NCCL_FILE_PATTERN)
    return out
