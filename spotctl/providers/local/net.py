"""Local nodes in their own network namespaces (spec `[local] netns = true`, root and
iproute2 needed): every node gets a namespace with one `eth0` on a bridge of the
cluster's own, so head, rendezvous and gloo traffic crosses real (virtual) links, and a
node can be cut off from the network by taking its link down, as a partition would.

Addresses come from 10.213.K.0/24, K derived from the cluster directory, used only
between this machine and the namespaces it made (the project's own test hosts).

The link model (spec `[local] link_in_zone` / `link_between_zones`, e.g. "1gbit 1ms" and
"100mbit 40ms"): every node's eth0 sends through an HTB with two classes, each with a
`tc netem` delay under it. Packets to a node of the same emulated zone take the in-zone
class (a u32 filter per peer address); everything else, other zones and this machine's
bridge where the head listens, takes the between-zones class. Each direction is shaped
at its sender, so a round trip pays the delay twice."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from spotctl.errors import SpotctlError

NODE_IFNAME = "eth0"
_LINK_RE = re.compile(
    r"\s*(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)(?:\s+(\d+(?:\.\d+)?)\s*(us|ms|s))?\s*", re.IGNORECASE)
_RATE_KBIT = {"kbit": 1.0, "mbit": 1e3, "gbit": 1e6}
_DELAY_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
MAX_RATE_KBIT = 10e6  # 10 Gbit/s: HTB's 32-bit rates hold it on every kernel
UNSHAPED = "10gbit"  # the class of a link the spec leaves unset


@dataclass(frozen=True)
class Link:
    """One emulated link: a rate and a one-way delay (what `tc netem` adds per packet)."""

    rate_kbit: float
    delay_ms: float

    @classmethod
    def parse(cls, text: str) -> Link:
        """"100mbit 40ms" -> Link(100_000, 40.0), "100mbit" -> no delay; ValueError naming
        what is wrong."""
        m = _LINK_RE.fullmatch(text)
        if m is None:
            raise ValueError(f"{text[:40]!r} is not a link: a rate and, where wanted, a "
                             'one-way delay, e.g. "100mbit 40ms" or "100mbit" (rate in kbit, '
                             "mbit or gbit; delay in us, ms or s)")
        rate = float(m[1]) * _RATE_KBIT[m[2].lower()]
        delay = float(m[3]) * _DELAY_MS[m[4].lower()] if m[3] else 0.0
        if not 8 <= rate <= MAX_RATE_KBIT:
            raise ValueError(f"{text.strip()!r}: the rate must be within 8kbit..10gbit")
        if delay > 10_000:
            raise ValueError(f"{text.strip()!r}: the delay must be at most 10s")
        return cls(rate, delay)

    @property
    def tc_rate(self) -> str:
        return f"{self.rate_kbit:g}kbit"

    @property
    def tc_delay(self) -> str:
        return f"{self.delay_ms * 1000:.0f}us"


def netem_missing() -> str | None:
    """Why this kernel cannot add delays (no sch_netem: some VM kernels leave it out), or
    None. Rates need only HTB."""
    ns = f"spotctl-netem-probe-{os.getpid()}"
    try:
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        p = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "p0",
                            "root", "netem", "delay", "1ms"], capture_output=True, text=True)
    except (SpotctlError, OSError) as e:
        return f"no network namespace to try tc netem in ({e})"
    finally:
        _ip("netns", "del", ns, check=False)
    if p.returncode != 0:
        return ("this kernel has no tc netem (CONFIG_NET_SCH_NETEM), which the link model's "
                f"delays need ({p.stderr.strip()})")
    return None


def _tc(ns: str, *args: str) -> None:
    p = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise SpotctlError(f"tc {' '.join(args)} in {ns}: {p.stderr.strip() or p.returncode}")


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

    def shape(self, n: int, inner: Link | None, outer: Link | None) -> None:
        """Node n's link model: class 1:10 (same zone, `inner`) and 1:20 (the rest,
        `outer`, the default); an unset link is a fast class with no delay. Peers of its
        zone are added with `same_zone`."""
        ns = self.netns(n)
        _tc(ns, "qdisc", "replace", "dev", NODE_IFNAME, "root", "handle", "1:", "htb",
            "default", "20")
        for cls, link in (("10", inner), ("20", outer)):
            rate = link.tc_rate if link else UNSHAPED
            _tc(ns, "class", "add", "dev", NODE_IFNAME, "parent", "1:", "classid",
                f"1:{cls}", "htb", "rate", rate, "ceil", rate)
            if link and link.delay_ms > 0:
                # limit: packets queued in the delay line (the default 1000 drops a
                # window of a fast link under a long delay)
                _tc(ns, "qdisc", "add", "dev", NODE_IFNAME, "parent", f"1:{cls}", "handle",
                    f"{cls}:", "netem", "delay", link.tc_delay, "limit", "100000")

    def same_zone(self, n: int, peer_ip: str) -> None:
        """Traffic from node n to `peer_ip` takes the in-zone class."""
        _tc(self.netns(n), "filter", "add", "dev", NODE_IFNAME, "parent", "1:", "protocol",
            "ip", "prio", "1", "u32", "match", "ip", "dst", f"{peer_ip}/32", "flowid", "1:10")

    def shape_zones(self, zones: Mapping[int, str], inner: Link | None,
                    outer: Link | None) -> None:
        """The link model on nodes made together: node -> zone (scripts/bench zones)."""
        for n in zones:
            self.shape(n, inner, outer)
        for a, za in zones.items():
            for b, zb in zones.items():
                if a != b and za == zb:
                    self.same_zone(a, self.node_ip(b))

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
