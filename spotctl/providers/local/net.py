"""Local nodes in their own network namespaces (spec `[local] netns = true`, root and
iproute2 needed): every node gets a namespace with one `eth0` on a bridge of the
cluster's own, so head, rendezvous and gloo traffic crosses real (virtual) links, and a
node can be cut off from the network by taking its link down, as a partition would.

Addresses come from 10.213.K.0/24, K derived from the cluster directory, used only
between this machine and the namespaces it made (the project's own test hosts)."""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

from spotctl.errors import SpotctlError

NODE_IFNAME = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise SpotctlError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p


@dataclass(frozen=True)
class ClusterNet:
    key: str  # 4 hex chars naming this cluster's links
    subnet: int  # K in 10.213.K.0/24

    @classmethod
    def for_dir(cls, cluster_dir: Path) -> ClusterNet:
        h = hashlib.sha256(str(cluster_dir).encode()).hexdigest()
        return cls(key=h[:4], subnet=int(h[4:8], 16) % 250 + 1)

    @property
    def bridge(self) -> str:
        return f"spb{self.key}"

    @property
    def host_ip(self) -> str:
        return f"10.213.{self.subnet}.1"

    def node_ip(self, n: int) -> str:
        if not 1 <= n <= 250:
            raise SpotctlError(f"netns mode holds at most 250 nodes (node n{n})")
        return f"10.213.{self.subnet}.{n + 1}"

    def netns(self, n: int) -> str:
        return f"spotctl-{self.key}-n{n}"

    def host_veth(self, n: int) -> str:
        return f"spv{self.key}{n}"

    def ensure_bridge(self) -> None:
        if _ip("link", "show", self.bridge, check=False).returncode != 0:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_node(self, n: int) -> str:
        """Namespace + veth for node n; returns its address."""
        ns, hv, tmp = self.netns(n), self.host_veth(n), f"spt{self.key}{n}"
        self.remove_node(n)
        _ip("netns", "add", ns)
        _ip("link", "add", hv, "type", "veth", "peer", "name", tmp)
        _ip("link", "set", tmp, "netns", ns)
        _ip("link", "set", hv, "master", self.bridge, "up")
        _ip("-n", ns, "link", "set", tmp, "name", NODE_IFNAME)
        _ip("-n", ns, "addr", "add", f"{self.node_ip(n)}/24", "dev", NODE_IFNAME)
        _ip("-n", ns, "link", "set", NODE_IFNAME, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return self.node_ip(n)

    def exec_prefix(self, n: int) -> list[str]:
        return ["ip", "netns", "exec", self.netns(n)]

    def cut(self, n: int) -> None:
        """Take node n's link down: it can reach nothing and nothing can reach it."""
        _ip("link", "set", self.host_veth(n), "down")

    def remove_node(self, n: int) -> None:
        _ip("link", "del", self.host_veth(n), check=False)
        _ip("netns", "del", self.netns(n), check=False)

    def remove_bridge(self) -> None:
        _ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        out = []
        names = _ip("netns", "list", check=False).stdout
        out += [f"netns {x.split()[0]}" for x in names.splitlines()
                if x.startswith(f"spotctl-{self.key}-")]
        links = _ip("-o", "link", "show", check=False).stdout
        out += [f"link {x.split(':')[1].strip().split('@')[0]}" for x in links.splitlines()
                if f"sp{'b'}{self.key}" in x or f"spv{self.key}" in x]
        return out
