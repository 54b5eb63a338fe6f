"""The local provider: nodes are detached process trees on this machine.

Each node is a `local_vm` process (its own metadata endpoint speaking the AWS and GCP
protocols) running the node agent, which runs torchrun and the workers. Nodes outlive the
CLI. The head is a local process too. Everything lives under the cluster directory:

    <cluster>/head/{head.json, head.log, events.jsonl}
    <cluster>/nodes/<id>/{vm.json, agent.json, token, node.log, agent.log, torchrun.log}
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spotctl.agent import proctree
from spotctl.agent.config import AgentConfig
from spotctl.errors import CapacityError, NotFoundError, SpotctlError
from spotctl.head.auth import node_token
from spotctl.head.client import urlopen_direct
from spotctl.providers.base import HeadInfo, Instance, Offer, ProviderContext
from spotctl.providers.local import private
from spotctl.state import write_json_atomic, write_private

HEAD_START_TIMEOUT_S = 60.0


def create(ctx: ProviderContext) -> LocalProvider:
    # a cluster on a private network: this command joins it before anything else
    # (spotctl.providers.local.private); `up` starts it in prepare()
    private.join(ctx.cluster_dir.path)
    return LocalProvider(ctx)


def _spawn(args: list[str], log: Path, tag: str, cwd: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env[proctree.TAG_VAR] = tag
    out = open(log, "ab")
    try:
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=str(cwd), env=env, start_new_session=True, close_fds=True,
        )
    finally:
        out.close()


class LocalProvider:
    name = "local"

    def __init__(self, ctx: ProviderContext):
        self.ctx = ctx
        self.spec = ctx.spec
        self.cdir = ctx.cluster_dir
        self.nodes_dir = self.cdir.nodes_dir
        self.head_dir = self.cdir.head_dir
        self.net = None
        if self.spec.local.netns:
            from spotctl.providers.local.net import ClusterNet

            self.net = ClusterNet.for_dir(self.cdir.path)
        # where the head listens: loopback, or the cluster bridge in netns mode
        self.host_addr = self.net.host_ip if self.net else "127.0.0.1"

    # -- tags
    def tag(self, node_id: str) -> str:
        return f"{self.cdir.path}/{node_id}"

    # -- capacity
    def capacity_now(self, now: float | None = None) -> int | None:
        """Nodes the local "cloud" can hold now, from spec.local.capacity (None = unlimited)."""
        steps = self.spec.local.capacity
        if not steps:
            return None
        from spotctl.providers.local import capacity

        cfg = capacity.read_config(self.cdir.path)
        if cfg is not None and cfg.get("override") is not None:
            return int(cfg["override"])  # pinned by capacity.set_capacity
        created = self._created_at()
        t = (now or time.time()) - created
        cap = None
        for s in steps:
            if s.at_s <= t:
                cap = s.nodes
        return cap if cap is not None else steps[0].nodes

    def _created_at(self) -> float:
        p = self.cdir.path / "created_at"
        if not p.exists():
            p.write_text(str(time.time()))
        return float(p.read_text())

    # -- protocol
    def offers(self) -> list[Offer]:
        lp = self.spec.local
        cap = self.capacity_now()
        room = None if cap is None else max(0, cap - len(self.list(self.ctx.cluster)))
        return [
            Offer(
                provider="local", region="local", zone=z, instance_type="local",
                gpus=lp.gpus_per_node, gpu_name="cpu", spot_price=lp.price_per_node,
                on_demand_price=lp.on_demand_price_per_node or None, interruption_band=None,
                # the whole local pool is one machine: offer what is left in the first zone
                available=None if room is None else (room if k == 0 else 0),
            )
            for k, z in enumerate(lp.zones)
        ]

    def _vm(self, node_id: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.nodes_dir / node_id / "vm.json").read_text())
        except (OSError, ValueError):
            return None

    def _node_ids(self) -> list[str]:
        if not self.nodes_dir.exists():
            return []
        # not a half-made node (.<id>.partial: launch writes its vm.json before the
        # rename that completes it; a launch killed in between leaves it to the next)
        ids = [p.name for p in self.nodes_dir.iterdir()
               if not p.name.startswith(".") and (p / "vm.json").exists()]
        return sorted(ids, key=lambda s: (len(s), s))

    def _alive(self, vm: dict[str, Any]) -> bool:
        pid = int(vm.get("pid") or 0)
        if not pid or not proctree.alive(pid):
            return False
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False
        return f"{proctree.TAG_VAR}={self.tag(vm['node_id'])}".encode() in env.split(b"\0")

    def _instance(self, vm: dict[str, Any]) -> Instance:
        state = vm.get("state", "pending")
        if state in ("running", "pending") and not self._alive(vm):
            # a process that died without saying so (SIGKILL, crash): the VM is gone
            state = "gone" if state == "running" or time.time() - vm["launched_at"] > 30 else state
        elif state not in ("running", "pending"):
            state = "gone"
        return Instance(
            id=vm["node_id"], cluster=self.ctx.cluster, role="worker", zone=vm["zone"],
            instance_type="local", gpus=vm["gpus"], state=state, request_id=vm["request_id"],
            price=vm.get("price", 0.0), on_demand_price=vm.get("on_demand_price", 0.0),
            launched_at=vm["launched_at"], address=vm.get("address", "127.0.0.1"), spot=True,
            meta={"dir": str(self.nodes_dir / vm["node_id"]), "pid": vm.get("pid"),
                  "metadata_url": vm.get("metadata_url", ""), "end_state": vm.get("state")},
        )

    def list(self, cluster: str) -> builtins.list[Instance]:
        out = []
        for nid in self._node_ids():
            vm = self._vm(nid)
            if vm is None:
                continue
            inst = self._instance(vm)
            if inst.state != "gone":
                out.append(inst)
        return out

    def all_instances(self) -> builtins.list[Instance]:
        """Live and gone, for status and accounting."""
        return [self._instance(vm) for nid in self._node_ids() if (vm := self._vm(nid))]

    def launch(self, offer: Offer, count: int, request_id: str) -> builtins.list[Instance]:
        """Idempotent by request id: a retried request (the CLI died mid-launch) completes
        the nodes it already made instead of making more."""
        mine = [
            vm for nid in self._node_ids()
            if (vm := self._vm(nid)) and vm.get("request_id") == request_id
        ]
        for vm in mine:
            if vm.get("state") == "pending" and not vm.get("pid") and not proctree.tagged(
                self.tag(vm["node_id"])
            ):
                self._spawn_vm(vm["node_id"])  # made, but the VM was never started
        need = count - len(mine)
        if need <= 0:
            return [self._instance(self._vm(vm["node_id"]) or vm) for vm in mine]
        cap = self.capacity_now()
        live = len(self.list(self.ctx.cluster))
        if cap is not None and live + need > cap:
            raise CapacityError(
                f"local capacity is {cap} node(s) now and {live} run: no room for {need} more "
                f"in {offer.zone}"
            )
        head = self.head_info()
        self.nodes_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in self.nodes_dir.glob(".*.partial"):
            shutil.rmtree(stale, ignore_errors=True)  # an interrupted launch's half-made node
        names = [p.name for p in self.nodes_dir.iterdir()]
        n = max((int(x[1:]) for x in names if x[:1] == "n" and x[1:].isdigit()), default=0)
        out = [self._instance(self._vm(vm["node_id"]) or vm) for vm in mine]
        for _ in range(need):
            n += 1
            nid = f"n{n}"
            # build the node under a temporary name, then rename: a node dir either is
            # complete (vm.json with the request id) or does not exist
            d = self.nodes_dir / f".{nid}.partial"
            d.mkdir(mode=0o700)
            addr = self.net.add_node(n) if self.net else "127.0.0.1"
            if self.net:
                self._shape(n, offer.zone)
            env = self.spec.train.worker_env()
            if self.spec.train.engine == "torchft":
                # the nodes launched together start together: their replicas' first quorum
                # waits (bounded) for this many (spotctl.elastic.ft)
                env.setdefault("SPOTCTL_FT_START_REPLICAS", str(count))
            if self.net:
                from spotctl.providers.local.net import NODE_IFNAME

                env.setdefault("GLOO_SOCKET_IFNAME", NODE_IFNAME)
            final = self.nodes_dir / nid
            # the node's own credential: it can speak for this node only
            write_private(d / "token", node_token(self.cdir.token(), nid))
            tr = self.spec.train
            cfg = AgentConfig(
                cluster=self.ctx.cluster, node_id=nid, head_url=head.url,
                store_host=head.store_host, store_port=head.store_port,
                token_file=str(final / "token"), workdir=str(final), script=tr.script,
                args=tr.args, nproc_per_node=offer.gpus,
                max_nodes=max(1, self.spec.gpus.max // offer.gpus),
                checkpoint_dir=tr.checkpoint_dir or str(self.cdir.checkpoints),
                checkpoint_every=tr.checkpoint_every, checkpoint_every_s=tr.checkpoint_every_s,
                keep_last=tr.keep_last, checkpoint_writers=tr.checkpoint_writers,
                max_steps=tr.max_steps, python=tr.python, env=env,
                local_addr=addr, metadata="local", poll_interval_s=0.2,
                engine=tr.engine, replica_nodes=tr.nodes_per_replica,
                lighthouse=self._lighthouse_addr() if tr.engine == "torchft" else "",
            )
            cfg.save(d / "agent.json")
            vm = {
                "node_id": nid, "request_id": request_id, "zone": offer.zone,
                "gpus": offer.gpus, "price": offer.spot_price,
                "on_demand_price": offer.on_demand_price or 0.0,
                "launched_at": time.time(), "state": "pending", "pid": None,
                "address": addr, "net_index": n if self.net else None,
            }
            write_json_atomic(d / "vm.json", vm)
            d.rename(final)
            self._spawn_vm(nid)
            out.append(self._instance(self._vm(nid) or vm))
        return out

    def _check_links(self) -> None:
        """Before anything starts: a link model with delays needs tc netem in this kernel."""
        from spotctl.providers.local.net import Link, netem_missing

        lp = self.spec.local
        if any(x and Link.parse(x).delay_ms > 0
               for x in (lp.link_in_zone, lp.link_between_zones)):
            why = netem_missing()
            if why:
                raise SpotctlError(f"[local] link_in_zone / link_between_zones: {why}; give "
                                   'rates only (e.g. "100mbit") on this machine')

    def _shape(self, n: int, zone: str) -> None:
        """The link model ([local] link_in_zone / link_between_zones) on node n's link, and
        the in-zone class between it and every node of its zone (both ways)."""
        lp = self.spec.local
        if self.net is None or not (lp.link_in_zone or lp.link_between_zones):
            return
        from spotctl.providers.local.net import Link

        self.net.shape(n, Link.parse(lp.link_in_zone) if lp.link_in_zone else None,
                       Link.parse(lp.link_between_zones) if lp.link_between_zones else None)
        me = self.net.node_ip(n)
        for nid in self._node_ids():
            vm = self._vm(nid)
            peer = vm.get("net_index") if vm else None
            if vm is None or peer is None or vm.get("zone") != zone or peer == n:
                continue
            if vm.get("state") not in ("running", "pending"):
                continue
            self.net.same_zone(n, self.net.node_ip(int(peer)))
            try:
                self.net.same_zone(int(peer), me)
            except SpotctlError:
                pass  # a peer whose namespace is gone (killed, not yet reaped) sends nothing

    def _spawn_vm(self, nid: str) -> None:
        # the VM writes its own pid and state into vm.json once it is up
        d = self.nodes_dir / nid
        prefix: list[str] = []
        if self.net is not None:
            prefix = self.net.exec_prefix(int(nid[1:]))
        _spawn([*prefix, sys.executable, "-m", "spotctl.providers.local.vm", str(d)],
               d / "node.log", self.tag(nid), d)

    def terminate(self, ids: Sequence[str]) -> None:
        for nid in ids:
            vm = self._vm(nid)
            if vm is None:
                continue
            proctree.kill_tag(self.tag(nid), root=int(vm.get("pid") or 0) or None)
            if self.net is not None:
                self.net.remove_node(int(nid[1:]))
            from spotctl.agent.supervisor import remove_zygote_dirs

            remove_zygote_dirs(self.nodes_dir / nid)
            if vm.get("state") in ("running", "pending"):
                vm["state"] = "terminated"
                vm["ended_at"] = time.time()
                write_json_atomic(self.nodes_dir / nid / "vm.json", vm)

    # -- head
    def head_info(self) -> HeadInfo:
        p = self.head_dir / "head.json"
        if not p.exists():
            raise SpotctlError("the cluster's head is not running")
        h = json.loads(p.read_text())
        return HeadInfo(url=h["url"], store_host=h["store_host"], store_port=h["store_port"])

    def _head_ok(self) -> bool:
        p = self.head_dir / "head.json"
        if not p.exists():
            return False
        try:
            h = json.loads(p.read_text())
        except ValueError:
            return False
        if not proctree.alive(int(h.get("pid", 0))):
            return False
        req = urllib.request.Request(h["url"] + "/api/health")
        req.add_header("Authorization", f"Bearer {self.cdir.token()}")
        try:
            with urlopen_direct(req, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def prepare(self) -> None:
        self.cdir.ensure()
        self.cdir.token(create=True)
        if self.net is not None:
            self._check_links()
            self.net.ensure_bridge()
        self._private_network()
        created = self._created_at()
        cap_file = self.cdir.path / "capacity.json"
        if self.spec.local.capacity:
            from spotctl.providers.local import capacity

            old = capacity.read_config(self.cdir.path) or {}
            new = {"created_at": created,
                   "schedule": [s.model_dump() for s in self.spec.local.capacity],
                   "notice_s": self.spec.local.reclaim_notice_s}
            # rewritten only when the spec changed: a read-modify-write on every reconcile
            # would race capacity.set_capacity and could put back an old override
            if {k: old.get(k) for k in new} != new:
                write_json_atomic(cap_file, new | (
                    {"override": old["override"]} if old.get("override") is not None else {}))
        else:
            cap_file.unlink(missing_ok=True)

    def _private_network(self) -> None:
        """Start the cluster's private network and move this command into it
        ([local] private_network: true, or unset where this machine allows it), before
        the head or any node is started. Unset and not to be had: the cluster stays on
        this machine's loopback, and private-net.log says why (`up` prints it)."""
        mode = private.setting(self.spec)
        if mode == "off" or private.holder(self.cdir.path) is not None:
            return
        want = mode == "on"
        if self._head_ok():  # it runs on this machine's loopback already
            if want:
                raise SpotctlError(
                    f"cluster {self.ctx.cluster} runs on this machine's loopback: "
                    "`spotctl down` it before turning [local] private_network on")
            return
        if not private.JOIN and not want:
            return  # called from a Python program, which no private network takes in
        try:
            h = private.start(self.cdir.path, {proctree.TAG_VAR: self.tag("private-net")})
        except SpotctlError:
            if want:
                raise
            return
        private.enter(h)

    def ensure_head(self) -> HeadInfo:
        if self._head_ok():
            return self.head_info()
        self.head_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        old_pid = None
        p = self.head_dir / "head.json"
        if p.exists():
            try:
                old_pid = json.loads(p.read_text()).get("pid")
            except ValueError:
                pass
            # keep the same ports across a restart so running agents find it again
        ports = self._head_ports()
        args = [
            sys.executable, "-m", "spotctl.cli.app", "head", "--dir", str(self.head_dir),
            "--token-file", str(self.cdir.token_file), "--host", self.host_addr,
            "--http-port", str(ports[0]), "--store-port", str(ports[1]), "--supervise",
        ]
        if self.spec.train.engine == "torchft":
            args += ["--lighthouse-port", str(self._lighthouse_port())]
        if self.spec.head_rebalances:
            # the head replaces lost nodes itself, from this controller's state directory
            args += ["--rebalance", self.spec.name,
                     "--rebalance-home", str(self.cdir.home),
                     "--rebalance-interval", f"{self.spec.rebalance.on_head_interval_s:g}"]
        if not self._supervisor_alive():
            _spawn(args, self.head_dir / "head.log", self.tag("head"), self.head_dir)
        # else: the supervisor is restarting the head; wait for it
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if p.exists():
                try:
                    pid = json.loads(p.read_text()).get("pid")
                except ValueError:
                    pid = None
                if pid and pid != old_pid and self._head_ok():
                    return self.head_info()
            time.sleep(0.2)
        log = (self.head_dir / "head.log").read_text()[-2000:]
        raise SpotctlError(f"the head did not start within {HEAD_START_TIMEOUT_S:.0f}s: {log}")

    def _supervisor_alive(self) -> bool:
        try:
            pid = int((self.head_dir / "supervisor.pid").read_text())
        except (OSError, ValueError):
            return False
        return pid in proctree.tagged(self.tag("head"))

    def _head_ports(self) -> tuple[int, int]:
        p = self.head_dir / "ports.json"
        if p.exists():
            d = json.loads(p.read_text())
            return int(d["http"]), int(d["store"])
        from spotctl.sockets import spare_port

        http = spare_port()
        store = spare_port(avoid=(http,))
        write_json_atomic(p, {"http": http, "store": store})
        return http, store

    def _lighthouse_port(self) -> int:
        """The head's torchft Lighthouse port, kept across head restarts like the others."""
        p = self.head_dir / "ports.json"
        d = json.loads(p.read_text()) if p.exists() else {}
        if "lighthouse" not in d:
            from spotctl.sockets import spare_port

            d["lighthouse"] = spare_port(avoid=(int(d.get("http", 0)), int(d.get("store", 0))))
            write_json_atomic(p, d)
        return int(d["lighthouse"])

    def _lighthouse_addr(self) -> str:
        try:
            return str(json.loads((self.head_dir / "head.json").read_text()).get("lighthouse", ""))
        except (OSError, ValueError):
            return ""

    def stop_head(self) -> builtins.list[int]:
        p = self.head_dir / "head.json"
        pid = None
        if p.exists():
            try:
                pid = json.loads(p.read_text()).get("pid")
            except ValueError:
                pid = None
        return proctree.kill_tag(self.tag("head"), root=pid)

    def cleanup(self) -> builtins.list[str]:
        leaks = []
        for nid in self._node_ids():
            self.terminate([nid])
            left = proctree.tagged(self.tag(nid))
            if left:
                leaks.append(f"node {nid}: processes {left} still alive")
        left_head = self.stop_head()
        if left_head:
            leaks.append(f"head: processes {left_head} still alive")
        if self.net is not None:
            self.net.remove_bridge()
            leaks += self.net.leftovers()
        private.stop(self.cdir.path)
        return leaks

    @property
    def can_purge(self) -> bool:
        """`down --purge` deletes the checkpoints spotctl put in the cluster's directory,
        never a train.checkpoint_dir the user named (that one is theirs)."""
        return not self.spec.train.checkpoint_dir

    def checkpoints_at(self) -> str:
        """Where the cluster's checkpoints are (what `down` says it kept)."""
        return self.spec.train.checkpoint_dir or str(self.cdir.checkpoints)

    def purge_checkpoints(self) -> int:
        """Delete the cluster's checkpoint directory; how many files were in it."""
        import shutil

        root = self.cdir.checkpoints
        if not root.is_dir():
            return 0
        n = sum(1 for p in root.rglob("*") if not p.is_dir())
        shutil.rmtree(root)
        (self.cdir.path / "job.json").unlink(missing_ok=True)
        return n

    # -- local-only controls
    def preempt(self, node_id: str, style: str, in_s: float | None) -> dict[str, Any]:
        vm = self._vm(node_id)
        if vm is None:
            raise NotFoundError(f"no node {node_id!r} in cluster {self.ctx.cluster}")
        if not vm.get("metadata_url") or not self._alive(vm):
            raise SpotctlError(f"node {node_id} is not running")
        body: dict[str, Any] = {"style": style}
        if in_s is not None:
            body["in_s"] = in_s
        req = urllib.request.Request(
            vm["metadata_url"] + "/_spotctl/preempt", data=json.dumps(body).encode(),
            method="POST",
        )
        req.add_header("Authorization", f"Bearer {self.cdir.token()}")
        req.add_header("Content-Type", "application/json")
        try:
            with urlopen_direct(req, timeout=5) as r:
                return json.loads(r.read() or b"{}")
        except (urllib.error.URLError, OSError) as e:
            raise SpotctlError(f"node {node_id}: metadata endpoint did not answer: {e}") from None

    def isolate(self, node_id: str) -> None:
        """netns mode: cut the node off the network (its link goes down); it keeps running."""
        if self.net is None:
            raise SpotctlError("isolating a node needs `[local] netns = true`")
        if self._vm(node_id) is None:
            raise NotFoundError(f"no node {node_id!r} in cluster {self.ctx.cluster}")
        self.net.cut(int(node_id[1:]))

    def kill(self, node_id: str) -> None:
        """Hard failure: SIGKILL the node's whole process tree, no notice."""
        vm = self._vm(node_id)
        if vm is None:
            raise NotFoundError(f"no node {node_id!r} in cluster {self.ctx.cluster}")
        proctree.kill_tag(self.tag(node_id), root=int(vm.get("pid") or 0) or None)
