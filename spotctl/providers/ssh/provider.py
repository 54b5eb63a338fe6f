"""The `ssh` provider: machines the user already has, listed in `[[ssh.hosts]]`.

Nothing is bought, launched or powered off. `launch` *joins* free hosts to the cluster
(recorded in `<cluster dir>/ssh_nodes.json`), `bootstrap` makes them nodes over SSH, and
`terminate` *releases* them: the agent is stopped and the token removed, the machine stays.
The head runs on the controller, as for the local provider, on its 127.0.0.1 only; agents on
other machines reach it through a reverse SSH forward per host (spotctl.remote.revtunnel)
on their own loopback, so the store is never opened to a network. With `[train] engine =
"torchft"` the head also runs torchft's Lighthouse (as for the local provider), forwarded
the same way.

Delivery: with `[train] python` empty, each host gets this controller's spotctl wheel, its
pinned dependencies and the project directory (spotctl.remote.package) and runs them in a
venv made from the host's `python3` (its torch reused when it has one). With `python` set,
that interpreter must already have spotctl and torch on every host; nothing is installed.
Checkpoints: an object-store URI, or a path under `[train] shared_mount` (a mount every
host has); the controller's own directory only when every host is this machine (loopback).

Node ids are stable per host (`ssh-<address>-<port>`, with `-2`, `-3` for repeats), so a
host keeps its id and its pinned host key across `down`/`up`.
A host with `notice_file` is preemptible: its agent watches that file for an eviction.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from spotctl.agent.config import AgentConfig
from spotctl.errors import BootstrapError, CapacityError, SpecError, TransientError
from spotctl.head.auth import node_token
from spotctl.providers.base import HeadInfo, Instance, Offer, ProviderContext
from spotctl.remote.bootstrap import (
    BootstrapFiles,
    HeadProbe,
    HostProgress,
    HostResult,
    bootstrap_hosts,
    python_chooser,
    release_hosts,
    render_bootstrap,
    start_together,
)
from spotctl.remote.package import (
    NodePackage,
    Project,
    node_package,
    packages_for,
    project_files,
)
from spotctl.remote.ssh import HostTarget
from spotctl.sockets import is_loopback
from spotctl.spec import SshHost
from spotctl.state import write_json_atomic

STATE_FILE = "ssh_nodes.json"
REMOTE_ROOT_VAR = "SPOTCTL_SSH_REMOTE_ROOT"
TUNNEL_VAR = "SPOTCTL_SSH_TUNNEL"
TUNNELS_DIR = "tunnels"
_URI = re.compile(r"^[a-z][a-z0-9+.-]*://")


# the class defines a method named `list`, which shadows the builtin in its annotations
_HostResults = list[HostResult]
_Strs = list[str]


def create(ctx: ProviderContext) -> SshProvider:
    return SshProvider(ctx)


def host_ids(hosts: Sequence[SshHost]) -> list[tuple[str, SshHost]]:
    """Stable node ids: from address and port, numbered when a host is listed twice."""
    seen: dict[str, int] = {}
    out = []
    for h in hosts:
        base = "ssh-" + re.sub(r"[^a-z0-9]+", "-", f"{h.address}-{h.port}".lower()).strip("-")
        seen[base] = seen.get(base, 0) + 1
        out.append((base if seen[base] == 1 else f"{base}-{seen[base]}", h))
    return out


class SshProvider:
    name = "ssh"

    def __init__(self, ctx: ProviderContext):
        self.ctx = ctx
        self.spec = ctx.spec
        self.cluster = ctx.cluster
        self.cdir = ctx.cluster_dir
        self.hosts = dict(host_ids(ctx.spec.ssh.hosts))
        opts = ctx.options
        # Node directories on the hosts; relative = under the remote user's $HOME.
        # SPOTCTL_SSH_REMOTE_ROOT moves them (loopback tests, hosts with a read-only $HOME).
        self.remote_root = str(
            opts.get("ssh_remote_root") or os.environ.get(REMOTE_ROOT_VAR) or ".spotctl"
        )
        self.wait_s = float(opts.get("ssh_wait_s", 120.0))
        self.heartbeat_timeout_s = float(opts.get("ssh_heartbeat_timeout_s", 120.0))
        # SSH work only: heartbeats are awaited outside these slots (bootstrap_hosts).
        self.parallel = int(opts.get("ssh_parallel", 32))
        # Upload the training script next to the agent (hosts without the project on disk).
        self.upload_script = bool(opts.get("ssh_upload_script", True))
        # Ship spotctl + the project (see the module docstring); base interpreter on hosts.
        self.deliver = bool(opts.get("deliver", not ctx.spec.train.python))
        self.base_python = str(opts.get("base_python") or ctx.spec.ssh.base_python)
        # Reverse tunnels: "auto" for hosts that are not this machine, "always", "never".
        self.tunnel = str(opts.get("ssh_tunnel") or os.environ.get(TUNNEL_VAR) or "auto")
        self._local: Any = None

    # -- joined hosts, recorded in the cluster directory
    @property
    def state_path(self) -> Path:
        return self.cdir.path / STATE_FILE

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """Read-modify-write of the joined-hosts record, one process at a time."""
        self.cdir.ensure()
        with open(self.cdir.path / (STATE_FILE + ".lock"), "w") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            data = self._read()
            yield data
            write_json_atomic(self.state_path, data, mode=0o600)

    def _read(self) -> dict[str, Any]:
        if not self.state_path.exists():
            return {"nodes": {}}
        return dict(json.loads(self.state_path.read_text()))

    def _record(self, node_id: str, h: SshHost, request_id: str) -> dict[str, Any]:
        return {
            "node_id": node_id, "address": h.address, "port": h.port, "user": h.user,
            "key": h.key, "gpus": h.gpus, "notice_file": h.notice_file,
            "request_id": request_id, "joined_at": time.time(), "state": "running",
            "remote_dir": f"{self.remote_root.rstrip('/')}/{self.cluster}/{node_id}",
        }  # fmt: skip

    def _instance(self, rec: dict[str, Any]) -> Instance:
        return Instance(
            id=rec["node_id"], cluster=self.cluster, role="worker", zone=rec["address"],
            instance_type="ssh", gpus=int(rec["gpus"]), state=rec.get("state", "running"),
            request_id=rec["request_id"], price=0.0, on_demand_price=0.0,
            launched_at=float(rec["joined_at"]), address=rec["address"],
            public_address=rec["address"], spot=bool(rec.get("notice_file")),
            ssh_port=int(rec["port"]), ssh_user=rec["user"],
            meta={k: rec[k] for k in ("address", "port", "user", "key", "remote_dir",
                                      "notice_file")},
        )  # fmt: skip

    @staticmethod
    def _target(inst: Instance) -> HostTarget:
        m = inst.meta
        return HostTarget(
            node_id=inst.id, address=str(m.get("address") or inst.public_address),
            port=int(m.get("port") or inst.ssh_port), user=str(m.get("user") or inst.ssh_user),
            key_path=str(m.get("key") or ""), remote_dir=str(m.get("remote_dir") or ""),
        )  # fmt: skip

    # -- the provider protocol
    def offers(self) -> list[Offer]:
        """One offer per host not yet joined (a joined host is no longer purchasable)."""
        joined = self._read()["nodes"]
        return [
            Offer(
                provider="ssh",
                region="ssh",
                zone=h.address,
                instance_type="ssh",
                gpus=h.gpus,
                gpu_name="ssh",
                spot_price=0.0,
                on_demand_price=0.0,
                available=1,
            )  # fmt: skip
            for nid, h in self.hosts.items()
            if nid not in joined
        ]

    def launch(self, offer: Offer, count: int, request_id: str) -> list[Instance]:
        """Join up to `count` free hosts at `offer.zone`; idempotent by request id."""
        with self._locked() as data:
            nodes = data["nodes"]
            mine = [r for r in nodes.values() if r["request_id"] == request_id]
            if mine:
                return [self._instance(r) for r in mine]
            free = [
                (nid, h) for nid, h in self.hosts.items()
                if nid not in nodes and h.address == offer.zone and h.gpus == offer.gpus
            ]  # fmt: skip
            if not free:
                raise CapacityError(
                    f"ssh: no free host at {offer.zone} with {offer.gpus} GPU(s) "
                    "(every listed host there is already joined)"
                )
            out = []
            for nid, h in free[: max(0, count)]:
                nodes[nid] = self._record(nid, h, request_id)
                out.append(self._instance(nodes[nid]))
            return out

    def list(self, cluster: str) -> list[Instance]:
        if cluster != self.cluster:
            return []
        return [self._instance(r) for r in self._read()["nodes"].values()]

    def terminate(self, ids: Sequence[str]) -> None:
        """Release hosts: stop the agent over SSH and delete the token there. The record is
        dropped even when a host is unreachable (it is the user's machine, not ours to
        chase); those hosts are named in a TransientError afterwards."""
        nodes = self._read()["nodes"]
        targets = [self._target(self._instance(nodes[i])) for i in ids if i in nodes]
        if not targets:
            return
        results = release_hosts(
            targets, self.cdir.known_hosts, self.parallel, wait_s=min(self.wait_s, 10.0)
        )
        from spotctl.remote import revtunnel

        with self._locked() as data:
            for t in targets:
                data["nodes"].pop(t.node_id, None)
                revtunnel.stop(self.cdir.path / TUNNELS_DIR, t.node_id)
        failed = [r for r in results if not r.ok]
        if failed:
            raise TransientError(
                "released, but could not stop the agent on: "
                + "; ".join(f"{r.node_id}: {r.reason}" for r in failed)
            )

    # -- bootstrap (called by the reconciler for providers that have it)
    def agent_config(self, inst: Instance, head: HeadInfo) -> AgentConfig:
        """The node's agent config; token_file and workdir are placed by the bootstrap."""
        tr = self.spec.train
        notice = str(inst.meta.get("notice_file") or "")
        return AgentConfig(
            cluster=self.cluster, node_id=inst.id, head_url=head.url,
            store_host=head.store_host, store_port=head.store_port, token_file="",
            workdir="work", script=tr.script, args=list(tr.args), nproc_per_node=inst.gpus,
            max_nodes=max(1, self.spec.gpus.max // max(1, inst.gpus)),
            checkpoint_dir=self.checkpoint_dir(),
            checkpoint_every=tr.checkpoint_every, checkpoint_every_s=tr.checkpoint_every_s,
            keep_last=tr.keep_last, checkpoint_writers=tr.checkpoint_writers,
            max_steps=tr.max_steps, python=tr.python, env=tr.worker_env(),
            local_addr=self.listen_address(inst), metadata="file" if notice else "none",
            notice_file=notice, engine=tr.engine, replica_nodes=tr.nodes_per_replica, lighthouse=self._lighthouse(head),
        )  # fmt: skip

    def listen_address(self, inst: Instance) -> str:
        """Where a node's training listeners bind: loopback when the cluster is one host
        (nothing of it is reachable from the host's network), else the host's address
        (the spec then says the network is trusted, or every host is on loopback)."""
        return "127.0.0.1" if len(self.spec.ssh.hosts) == 1 else inst.address

    def _lighthouse(self, head: HeadInfo) -> str:
        """The head's Lighthouse as this host reaches it; "" on torchrun."""
        if self.spec.train.engine != "torchft":
            return ""
        if not head.lighthouse:
            raise BootstrapError(
                "engine torchft: the head runs no torchft Lighthouse (is torchft installed on "
                "this controller? pip install 'spotctl[train]'; see the head's head.log)"
            )
        return head.lighthouse

    def checkpoint_dir(self) -> str:
        """Where every node reads and writes checkpoints: an object-store URI, a path under
        `train.shared_mount`, or (only when every host is this machine) the cluster dir."""
        cd = self.spec.train.checkpoint_dir
        shared = self.spec.train.shared_mount.rstrip("/")
        if cd and _URI.match(cd):
            return cd
        if not cd and shared:
            return f"{shared}/{self.cluster}/checkpoints"
        if cd and shared and (cd.rstrip("/") + "/").startswith(shared + "/"):
            return cd
        if all(is_loopback(h.address) for h in self.hosts.values()):
            return cd or str(self.cdir.checkpoints)
        raise SpecError(
            "train.checkpoint_dir: the ssh provider needs storage every host can read: an "
            "object-store URI (s3://..., gs://...) or a path under train.shared_mount "
            f"(got {cd or 'nothing'!r}{', shared_mount ' + repr(shared) if shared else ''})"
        )

    def _needs_tunnel(self, inst: Instance) -> bool:
        if self.tunnel == "never":
            return False
        return self.tunnel == "always" or not is_loopback(self._target(inst).address)

    def _tunnels(self, instances: Sequence[Instance], head: HeadInfo) -> dict[str, HeadInfo]:
        """Reverse forwards for hosts that need them: node id -> the head as that host
        sees it (127.0.0.1 and the host-side ports)."""
        from urllib.parse import urlparse

        from spotctl.remote import revtunnel

        api = urlparse(head.url).port or 80
        lighthouse = (urlparse(head.lighthouse).port or 0) if head.lighthouse else 0
        need = [i for i in instances if self._needs_tunnel(i)]

        def one(inst: Instance) -> HeadInfo:
            t = self._target(inst)
            spec = revtunnel.TunnelSpec(
                name=inst.id, address=t.address, port=t.port, user=t.user, key_file=t.key_path,
                known_hosts=str(self.cdir.known_hosts), local_api=api,
                local_store=head.store_port, local_lighthouse=lighthouse,
            )  # fmt: skip
            ports = revtunnel.ensure_ports(self.cdir.path / TUNNELS_DIR, spec)
            return dataclasses.replace(
                head, url=f"http://127.0.0.1:{ports.api}", store_host="127.0.0.1",
                store_port=ports.store,
                lighthouse=f"http://127.0.0.1:{ports.lighthouse}" if ports.lighthouse else "",
            )  # fmt: skip

        if not need:
            return {}
        # as many at a time as SSH slots (first contacts pin keys under a file lock)
        with ThreadPoolExecutor(max_workers=max(1, min(self.parallel, len(need)))) as pool:
            return dict(zip([i.id for i in need], pool.map(one, need), strict=True))

    def _package(self) -> tuple[NodePackage | None, Project | None]:
        if not self.deliver:
            return None, None
        script = Path(self.spec.train.script)
        root = script.resolve().parent if script.is_file() else Path.cwd()
        cache = self.cdir.home / "cache" / "package"
        also = packages_for(self.checkpoint_dir())
        # engine torchft: torchft (the `ft` extra) on every host
        extras = ("ft",) if self.spec.train.engine == "torchft" else ()
        return node_package(cache, extras=extras, also=also), project_files(root)

    def bootstrap(
        self,
        instances: Sequence[Instance],
        agent_config_for: Callable[[Instance], AgentConfig] | None = None,
        token: str | None = None,
        *,
        progress: HostProgress | None = None,
    ) -> _HostResults:
        """Make joined hosts nodes: upload, install if missing, start the agent, and wait
        for its first heartbeat at the head. Per-host results; never raises for one host."""
        token = token or self.cdir.token()
        self.checkpoint_dir()  # refuses storage the hosts cannot share, before any work
        head: HeadInfo | None = None
        if agent_config_for is None:
            head = self.head_info()
            via = self._tunnels(instances, head)
            n = len(instances)
            agent_config_for = lambda i: start_together(  # noqa: E731
                self.agent_config(i, via.get(i.id, head)), n)
        by_id = {i.id: i for i in instances}
        package, project = self._package()
        python = self.spec.train.python or (self.base_python if package else sys.executable)

        def render(t: HostTarget) -> BootstrapFiles:
            inst = by_id[t.node_id]
            cfg = dataclasses.replace(agent_config_for(inst))
            notice = self._notice_hosts().get(t.node_id) or str(inst.meta.get("notice_file") or "")
            if notice:
                cfg.metadata, cfg.notice_file = "file", notice
            extra: dict[str, bytes] = {}
            script = Path(cfg.script)
            if self.upload_script and script.is_file() and project is None:
                extra[f"train/{script.name}"] = script.read_bytes()
                cfg.script = f"{t.remote_dir}/train/{script.name}"
            # the node gets its own credential (bound to its id), never the cluster secret
            return render_bootstrap(t, cfg, node_token(token, cfg.node_id), python=python,
                                    extra=extra, package=package, project=project)

        probe_url = (head.public_url or head.url) if head else ""
        if not probe_url:
            first = next(iter(instances), None)
            probe_url = agent_config_for(first).head_url if first else ""
        probe = HeadProbe(probe_url, token) if probe_url else None
        return bootstrap_hosts(
            [self._target(i) for i in instances], render, self.cdir.known_hosts,
            self.parallel, progress, wait_s=self.wait_s, probe=probe,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            # each host is asked first: its torch environments, then base_python
            choose_python=python_chooser(package, self.spec.train.torch_envs, python),
        )  # fmt: skip

    def _notice_hosts(self) -> dict[str, str]:
        return {nid: h.notice_file for nid, h in self.hosts.items() if h.notice_file}

    # -- the head runs on the controller, exactly as for the local provider
    def _head(self) -> Any:
        if self._local is None:
            from spotctl.providers.local.provider import LocalProvider

            self._local = LocalProvider(self.ctx)
        return self._local

    def prepare(self) -> None:
        self.checkpoint_dir()  # a spec error, before anything is joined or started
        self._head().prepare()

    def ensure_head(self) -> HeadInfo:
        return self._with_lighthouse(self._head().ensure_head())

    def head_info(self) -> HeadInfo:
        return self._with_lighthouse(self._head().head_info())

    def _with_lighthouse(self, head: HeadInfo) -> HeadInfo:
        """The head's Lighthouse address (its head.json), which the local provider's
        HeadInfo does not carry."""
        if self.spec.train.engine != "torchft":
            return head
        try:
            rec = json.loads((self._head().head_dir / "head.json").read_text())
        except (OSError, ValueError):
            return head
        return dataclasses.replace(head, lighthouse=str(rec.get("lighthouse") or ""))

    def cleanup(self) -> _Strs:
        """Release every joined host and stop the head; returns what could not be stopped."""
        leaks: _Strs = []
        ids = [i.id for i in self.list(self.cluster)]
        try:
            self.terminate(ids)
        except TransientError as e:
            leaks.append(str(e))
        from spotctl.remote import revtunnel

        revtunnel.stop_all(self.cdir.path / TUNNELS_DIR)
        left = self._head().stop_head()
        if left:
            leaks.append(f"head: processes {left} still alive")
        return leaks
