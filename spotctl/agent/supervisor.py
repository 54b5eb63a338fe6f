"""The node agent: watches for notices, reports to the head, supervises torchrun and drives
the drain cycle on its node.

States (the agent's, reported to the head as agent_state):
  waiting  -> registered, not yet told to start (a join waits for the group to checkpoint);
              on a GPU type, torchrun starts only once the GPU gate opens
  failed   -> the GPU gate gave up (no driver, too few GPUs, CPU-only torch): nothing
              starts; reported to the head, and the controller replaces the node
  running  -> torchrun is up
  leaving  -> a notice came: its workers drained, torchrun is being stopped
  left     -> out of the rendezvous; waits to be terminated
  finished -> training ended (workers exited 0)
  crashed  -> its workers failed CRASH_LIMIT times in a row with the same last error line
              and no step in between (spotctl.agent.crashloop): not restarted again; the
              line goes to the head in every heartbeat (`status`, `up`)
Worker contract: environment variables (SPOTCTL_*) in, one status JSON file per local rank
out; SIGUSR1 asks workers to drain; SIGTERM ends them (they exit non-zero, so torchrun
restarts them into the next rendezvous round). A plain torchrun script (route "plain",
spotctl.elastic.plain) never gets SIGUSR1 (its default action kills): the agent writes the
notice file (SPOTCTL_NOTICE_FILE) instead, and its workers count as drained once they say
so (notice_saved) or their grace ends; SIGTERM then as above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spotctl.agent import gpugate, netprobe, runas
from spotctl.agent.config import AgentConfig
from spotctl.agent.crashloop import CrashWatch, crash_limit
from spotctl.head.client import HeadClient, HeadUnavailable
from spotctl.sockets import spare_port

log = logging.getLogger("spotctl.agent")
TICK_S = 0.25
# SIGTERM on a node whose metadata is GCP's (or the local emulator's): how long the agent
# waits for the notice to come (a Spot VM's preemption is an ACPI soft-off, so the OS stops
# the agent at the moment `preempted` turns TRUE), and how long before a notice's deadline
# it stops in any case
TERM_NOTICE_WAIT_S = 5.0
TERM_DEADLINE_MARGIN_S = 2.0
# a spanning replica group's nodes wait this long for the group's first node (the head
# moves the group to a new generation, which restarts them, when that node is gone)
GROUP_RDZV_TIMEOUT_S = 600
# a plain script's workers train on for this long after a notice file (SPOTCTL_NOTICE_GRACE_S
# in [train] env; bounded by the notice's deadline), then SIGTERM
NOTICE_GRACE_S = 30.0
MAX_NOTICE_GRACE_S = 120.0  # below the head's PLAIN_DRAIN_TIMEOUT_S
MAX_ROUND_NODES = 1 << 16
RDZV_CONF = "is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=900,read_timeout=30"


def torchrun_command(cfg: AgentConfig, master_port: int = 0,
                     group: dict[str, Any] | None = None) -> list[str]:
    py = cfg.python or sys.executable
    if cfg.engine == "torchft" and group is not None:
        # a replica group of several nodes (spotctl.head.groups): one torchrun across them,
        # a static rendezvous whose store listens on the group's first node, started anew
        # (with the generation in its id) whenever the group's membership changes
        host, port = group["master"]
        return [
            py, "-m", "spotctl.agent.launch", "-m", "torch.distributed.run",
            f"--nnodes={cfg.replica_nodes}", f"--nproc-per-node={cfg.nproc_per_node}",
            "--rdzv-backend=spotctl-node",
            f"--rdzv-endpoint={_endpoint(host, port)}",
            f"--rdzv-id={cfg.cluster}-{group['id']}-{group['gen']}",
            f"--rdzv-conf=rank={group['slot']},timeout={GROUP_RDZV_TIMEOUT_S}",
            f"--local-addr={cfg.local_addr}",
            "--max-restarts=0", "--monitor-interval=0.2",
            "-m", "spotctl.agent.launch", cfg.script, *cfg.args,
        ]
    if cfg.engine == "torchft":
        # one replica group per node: its own torchrun, no shared rendezvous; torchft's
        # Manager in each worker joins the quorum through the head's Lighthouse. The
        # group's store listens on the node's address only (spotctl.elastic.rdzv).
        # torchrun itself is forked by the node's zygote like its workers (its torch
        # imports, two CPU-seconds, are done there; cold when there is no zygote): it
        # starts once per node, on the way to the node's first step
        return [
            py, "-m", "spotctl.agent.launch", "-m", "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={cfg.nproc_per_node}",
            "--rdzv-backend=spotctl-node",
            f"--rdzv-endpoint={_endpoint(cfg.local_addr, master_port)}",
            f"--rdzv-id={cfg.cluster}",
            "--max-restarts=0", "--monitor-interval=0.2",
            "-m", "spotctl.agent.launch", cfg.script, *cfg.args,
        ]
    # torchrun forked by the zygote, as on torchft; it writes the pid it is listed under in
    # the rendezvous beside the gate, for the leave (spotctl.elastic.rdzv)
    return [
        py, "-m", "spotctl.agent.launch", "-m", "torch.distributed.run",
        f"--nnodes=1:{max(1, cfg.max_nodes)}",
        f"--nproc-per-node={cfg.nproc_per_node}",
        "--rdzv-backend=spotctl",  # c10d behind a gate (spotctl.elastic.rdzv)
        f"--rdzv-endpoint={cfg.store_host}:{cfg.store_port}",
        f"--rdzv-id={cfg.cluster}",
        f"--rdzv-conf={RDZV_CONF}",
        # every departure counts as a restart; the job must never run out of them
        "--max-restarts=1000000",
        "--monitor-interval=0.2",
        f"--local-addr={cfg.local_addr}",
        # each worker is forked from the node's warm zygote (torch already imported)
        "-m", "spotctl.agent.launch",
        cfg.script, *cfg.args,
    ]


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


SUN_PATH_MAX = 107  # a unix socket's path, in bytes, without its NUL


def _zygote_path(workdir: Path, worker: runas.WorkerUser | None = None) -> Path | None:
    """The zygote's socket, in a 0700 directory of the user the zygote and its workers run
    as, which that user (or the agent, for it) made: `run-<uid>` in the node's work dir,
    where no other user can write. Where that path is too long for a unix socket, a fresh
    directory with a random name in the temp dir (mkdtemp: created here or not at all).
    Never a fixed name in a shared temp dir, which another local user could create first
    and then answer in the zygote's place (issue 60). None, with one error line, when the
    directory in the work dir is not one only its owner could have made (cold starts)."""
    import tempfile

    uid, gid = (worker.uid, worker.gid) if worker else (os.getuid(), os.getgid())
    d = workdir / f"run-{uid}"
    made = False
    try:
        if len(os.fsencode(str(d / "z.sock"))) > SUN_PATH_MAX:
            d, made = Path(tempfile.mkdtemp(prefix=f"spotctl-{uid}-")), True
            # where it is, for remove_zygote_dirs after an agent that could not clean up
            with open(workdir / ZYGOTE_DIR_NOTE, "a") as f:
                f.write(f"{d}\n")
        return runas.private_dir(d, uid, gid, made) / "z.sock"
    except (runas.UnsafeDir, OSError) as e:
        log.error("no warm zygote (workers start cold): %s", e)
        return None


ZYGOTE_DIR_NOTE = "zygote-dir"


def remove_zygote_dirs(workdir: Path) -> None:
    """Remove a stopped node's zygote socket and its directory (the local provider, after
    it killed the node's processes)."""
    import shutil
    import tempfile

    for d in workdir.glob("run-*"):
        shutil.rmtree(d, ignore_errors=True)
    note = workdir / ZYGOTE_DIR_NOTE
    try:
        made = note.read_text().split("\n")
    except OSError:
        return
    for line in made:
        d = Path(line.strip())
        # only a directory of the shape _zygote_path makes in the temp dir
        if line and d.parent == Path(tempfile.gettempdir()) \
                and d.name.startswith("spotctl-") and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
    note.unlink(missing_ok=True)


class Agent:
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.workdir = Path(cfg.workdir)
        self.status_dir = self.workdir / "status"
        self.status_dir.mkdir(parents=True, exist_ok=True)
        # torchrun's rendezvous handler writes `<gate>.ready`: the gate lives where the
        # workers may write, next to their status files
        self.gate = self.status_dir / "rdzv-gate"
        # written on a notice: this node's torchrun then joins no new rendezvous round
        self.leaving_flag = Path(str(self.gate) + ".leaving")
        self.leaving_flag.unlink(missing_ok=True)
        # a plain script's notice (in the agent's own dir: workers read it, never write it)
        self.notice_path = self.workdir / "notice.json"
        self.notice_path.unlink(missing_ok=True)
        self.notice_grace_s = _grace(cfg.env.get("SPOTCTL_NOTICE_GRACE_S"))
        self.plain_grace_end: float | None = None  # when the noticed workers count as drained
        self.plain_noticed: set[int] = set()  # their pids
        self.worker = runas.resolve(cfg.run_as)
        if self.worker is not None:
            self.worker = self._worker_home(self.worker)
        if self.worker is not None and not self._prepare_worker_dirs(self.worker):
            self.worker = None
        self.zygote: subprocess.Popen[bytes] | None = None
        self.zygote_path = _zygote_path(self.workdir, self.worker)
        self.head = HeadClient(cfg.head_url, cfg.token(), timeout_s=2.0)
        self.state = "waiting"
        self.torchrun: subprocess.Popen[bytes] | None = None
        self.drain_gen = 0  # last drain gen signalled to workers
        self.release_gen = 0
        self.kill_gen = 0
        self.notice: dict[str, Any] | None = None
        self.notice_lock = threading.Lock()
        self.head_errors = 0
        self.monitors: Any = None
        self._stop = threading.Event()
        self._term_at: float | None = None  # when SIGTERM came (terminate())
        self._term_logged = False
        self.torchrun_restarts = 0
        self.next_start = 0.0
        # the same failure again and again: stop restarting (state "crashed", `error`)
        self.crash = CrashWatch(self.workdir / "torchrun.log", crash_limit({**os.environ,
                                                                          **cfg.env}))
        self.crash.skip_to_end()
        self.error: str | None = None
        # torchft, nodes_per_replica > 1: the port this node's group store listens on when
        # it holds its group's first slot; the group (id, gen, slot, master) its torchrun
        # runs in; and the last group generation that ended with a graceful leave (not
        # started again: the group waits for the head's next generation)
        self.group_port = spare_port(cfg.local_addr) if cfg.replica_nodes > 1 else 0
        self.group: dict[str, Any] | None = None
        self.group_done: tuple[str, int] | None = None
        # the group generation this node's torchrun failed in, until the head moved it on
        self.group_broken: dict[str, Any] | None = None
        # torchft, one node per replica: the dense replica index the head gave this node
        # (SPOTCTL_FT_REPLICA_INDEX, torchtitan's replica id) and the one its running
        # torchrun was started with (reported, so a restarted head keeps it)
        self.replica_index: int | None = None
        self.running_index: int | None = None
        self.head_id: str | None = None
        self._leaver: subprocess.Popen[bytes] | None = None
        self._leaver_lock = threading.Lock()
        self._warm = threading.Thread(target=self._import_torch, daemon=True)
        self._warm_lock = threading.Lock()
        # None while the GPU gate is probing; set once (see spotctl.agent.gpugate)
        self.gpu_gate: gpugate.GateResult | None = None
        self._gate_reported = False
        # what this node's network is (probed once) and the transport its workers' NCCL
        # named; sent to the head until the head that answers has the current value
        self.net: dict[str, Any] | None = None
        self.nccl_transport: str | None = None if cfg.expect_gpus else "gloo"
        self._net_acked: tuple[str | None, str | None] | None = None
        self._nccl_checked = -math.inf
        self._nccl_seen: dict[str, int] = {}  # debug file -> size when last read

    def _worker_home(self, w: runas.WorkerUser) -> runas.WorkerUser:
        """The training user is a system user with no home (`/nonexistent`, as the
        bootstrap makes it); scripts write under ~ all the same (the Hugging Face and
        torch.hub caches, ~/.config): unless its home is a directory it owns, its HOME is
        one of its own in the workdir."""
        try:
            if os.stat(w.home).st_uid == w.uid and Path(w.home).is_dir():
                return w
        except OSError:
            pass
        home = self.workdir / "home"
        runas.allow_search(self.workdir)
        runas.own_dir(home, w, 0o700)
        return dataclasses.replace(w, home=str(home))

    def _prepare_worker_dirs(self, w: runas.WorkerUser) -> bool:
        """Workers run as `w`: they write only their status dir (and a local checkpoint
        dir) and may traverse the workdir, whose logs stay the agent's."""
        runas.allow_search(self.workdir)
        runas.own_dir(self.status_dir, w)
        ck = self.cfg.checkpoint_dir
        if ck and "://" not in ck:
            ckp = Path(ck)
            if not ckp.exists():
                runas.own_dir(ckp, w, 0o755)
            elif ckp.stat().st_uid != w.uid:
                os.chown(ckp, w.uid, w.gid, follow_symlinks=False)
        script = Path(self.cfg.script) if self.cfg.script else None
        want = {str(self.workdir): os.X_OK, str(self.status_dir): os.W_OK | os.X_OK}
        if script is not None:
            want[str(script)] = os.R_OK
            want[str(script.parent)] = os.X_OK
        if ck and "://" not in ck:
            want[ck] = os.W_OK | os.X_OK
        bad = runas.unusable(w, self.cfg.python or sys.executable, want)
        if bad:
            # The bootstrap runs the agent as root only after checking this; an agent
            # started as root by hand gets its workers as root, as before, and says so.
            log.error("run_as=%s cannot use %s: training workers run as root instead; give "
                      "that user access (search on the directories above) or clear run_as",
                      w.name, ", ".join(bad))
            return False
        # this agent is root (resolve) and runs from sys.executable: if the workers' user
        # could change what that loads, a training script could run code as root at the
        # next start. The bootstrap asked before it started this agent; asked again here
        # for an agent started otherwise, or an interpreter changed since.
        path = runas.writable_by(w, sys.executable)
        if path:
            log.error("run_as=%s can write %s, which this root agent's python loads: "
                      "training workers run as root instead; make it unwritable by that "
                      "user or clear run_as", w.name, path)
            return False
        log.info("training workers run as %s (uid %d)", w.name, w.uid)
        return True

    def _warm_up(self) -> None:
        """Start _import_torch once, in the background: at a notice (the drain that comes
        first takes longer than the import) or at a leave, not at every agent's start (two
        CPU-seconds per node that most nodes never need)."""
        with self._warm_lock:
            if self._warm.ident is None:  # never started
                self._warm.start()

    def _import_torch(self) -> None:
        """Make the rendezvous leave cost no start-up time when it comes: start the leave
        server now. Only the torchrun engine gets here (_warm_up): torchft has no
        rendezvous to leave."""
        try:
            self._leave_server()
        except OSError as e:
            log.warning("rendezvous leave server: %s", e)

    def _leave_server(self) -> subprocess.Popen[bytes]:
        """The rendezvous leave server (spotctl.elastic.rdzv.serve_leaves), running as the
        training user: the rendezvous state is a pickle that anyone who reaches the store
        can write, and a root agent must never load it. Forked by the node's zygote when it
        runs (through spotctl.agent.launch, as a worker is), so that it is ready at once:
        started cold, its torch imports took longer than a notice's drain and held the
        leave, and with it the survivors' next round, for about a second."""
        with self._leaver_lock:
            srv = self._leaver
            if srv is not None and srv.poll() is None:
                return srv
            env = worker_env(os.environ, self.head.token)
            z = self.zygote
            if z is not None and z.poll() is None:
                env["SPOTCTL_ZYGOTE"] = str(self.zygote_path)
            kwargs: dict[str, Any] = {}
            if self.worker is not None:
                self.worker.env(env)
                kwargs = self.worker.popen_kwargs()
            err_log = open(self.workdir / "leave.log", "ab")  # never read by the agent
            srv = subprocess.Popen(
                [self.cfg.python or sys.executable, "-m", "spotctl.agent.launch",
                 "-m", "spotctl.agent.leave"], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_log,
                cwd=str(self.workdir), **kwargs)
            err_log.close()
            self._leaver = srv
            return srv

    def _leave_rendezvous(self, pid: int) -> bool:
        """Take this node's stopped torchrun out of the rendezvous, through the leave
        server. `pid`: the process the agent started; the pid torchrun is listed under is
        the one it wrote beside the gate (forked by the zygote, it is another process).
        Reads at most one short line back."""
        cfg = self.cfg
        pid_file = str(self.gate) + ".pid"
        from spotctl.agent.leave import LEAVE_ANSWERS  # (spotctl.elastic imports torch)

        srv = self._leave_server()
        assert srv.stdin is not None and srv.stdout is not None
        # the training user wrote the pid file: the leave server reads it, root does not
        req = {"host": cfg.store_host, "port": cfg.store_port, "run_id": cfg.cluster,
               "addr": cfg.local_addr, "pid": pid, "pid_file": pid_file}
        srv.stdin.write((json.dumps(req) + "\n").encode())
        srv.stdin.flush()
        # one word back, compared, never parsed (the server runs as the training user)
        fd, buf = srv.stdout.fileno(), b""
        end = time.monotonic() + 30  # interpreter start-up if it was not ready yet
        while b"\n" not in buf and len(buf) < 16 and time.monotonic() < end:
            r, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
            chunk = os.read(fd, 16 - len(buf)) if r else b""
            if not chunk:
                break
            buf += chunk
        answer = buf.split(b"\n", 1)[0]
        if answer not in LEAVE_ANSWERS[:2]:
            raise RuntimeError(f"leave server: no answer (see {self.workdir / 'leave.log'})")
        return answer == LEAVE_ANSWERS[0]

    # -- the GPU gate
    def _run_gpu_gate(self) -> None:
        cfg = self.cfg
        env = worker_env(os.environ, self.head.token)
        env.update(cfg.env)
        if self.worker is not None:
            self.worker.env(env)
        try:
            res = gpugate.wait_for_gpus(
                cfg.expect_gpus, cfg.python or sys.executable, env, cfg.gpu_wait_s,
                stop=self._stop.is_set,
                popen=self.worker.popen_kwargs() if self.worker else None)
        except Exception as e:  # the gate must end closed, never hang the agent
            res = gpugate.GateResult(False, f"GPU check failed: {e}", None, None, 0.0)
        if res.ok and cfg.expect_gpus:
            log.info("GPU gate open: nvidia-smi lists %s, torch sees %s GPU(s) (%.0fs)",
                     res.driver_gpus, res.torch_gpus, res.waited_s)
        self.gpu_gate = res

    def _gpus_ready(self) -> bool:
        """Whether workers may start; a closed gate turns the node `failed` and tells the
        head why (retried every tick until the head has it)."""
        res = self.gpu_gate
        if res is None:
            if self.notice is not None:
                self.state = "left"  # preempted while the driver came up: nothing to drain
            return False
        if res.ok:
            return True
        if self.state != "failed":
            self.state = "failed"
            log.error("GPU gate: %s; not starting workers (%d GPU(s) expected)",
                      res.reason, self.cfg.expect_gpus)
        if not self._gate_reported:
            try:
                self.head.event("gpu-gate-failed", node=self.cfg.node_id,
                                reason=res.reason[:1000])
                self._gate_reported = True
            except HeadUnavailable as e:
                log.warning("could not report the GPU gate: %s", e)
        return False

    # -- notices
    def on_notice(self, notice: Any) -> None:
        d = {
            "id": notice.id, "source": notice.source, "kind": notice.kind,
            "action": getattr(notice, "action", ""), "deadline": notice.deadline,
            "received_at": notice.received_at,
        }
        if d["deadline"] == float("inf"):
            # a rebalance recommendation is advice, not an eviction: report only
            try:
                self.head.event("rebalance-recommendation", node=self.cfg.node_id)
            except HeadUnavailable:
                pass
            return
        with self.notice_lock:
            if self.notice is not None:
                return
            self.notice = d
        if self.cfg.engine != "torchft":
            self._warm_up()  # the leave's imports, while the group drains
            # Before anything else: should the group break before the drain commits (a
            # peer killed at the same moment), torchrun must not re-form with the
            # survivors, only to leave again and restart them a second time.
            try:
                runas.touch(self.leaving_flag)
            except OSError as e:
                log.warning("could not write %s: %s", self.leaving_flag, e)
        log.info("notice %s (%s), deadline in %.1fs", d["kind"], d["source"],
                 d["deadline"] - time.time())
        try:
            self.head.notice(self.cfg.node_id, d)
        except HeadUnavailable as e:
            log.warning("could not report notice: %s", e)

    def _start_monitors(self) -> None:
        cfg = self.cfg
        if cfg.metadata == "none":
            return
        from spotctl.agent import monitors as m

        mons = m.build_monitors(cfg.metadata, cfg.metadata_url, cfg.notice_file,
                                cfg.poll_interval_s)
        self.monitors = m.MonitorLoop(mons, on_notice=self.on_notice,
                                      interval_s=cfg.poll_interval_s)
        self.monitors.start()

    # -- workers
    def read_workers(self) -> list[dict[str, Any]]:
        out = []
        for p in sorted(self.status_dir.glob("worker-*.json")):
            raw = runas.read_status(p)
            try:
                w = json.loads(raw) if raw is not None else None
            except ValueError:
                continue
            if isinstance(w, dict):
                out.append(w)
        return out

    def _live_workers(self, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        live = []
        for w in workers:
            pid = int(w.get("pid") or 0)
            if pid and Path(f"/proc/{pid}").exists():
                live.append(w)
        return live

    def signal_workers(self, sig: int, workers: list[dict[str, Any]]) -> None:
        for w in workers:
            try:
                pid = int(w["pid"])
                # a root agent signals only its workers' processes, whatever pid a
                # status file (written by a worker) names
                if pid > 0 and (self.worker is None or self.worker.owns(pid)):
                    os.kill(pid, sig)
            except (ProcessLookupError, KeyError, ValueError, TypeError, PermissionError):
                pass

    def start_torchrun(self) -> None:
        cfg = self.cfg
        for p in self.status_dir.glob("worker-*.json"):
            p.unlink(missing_ok=True)
        self._end_plain_notice()
        self.gate.unlink(missing_ok=True)
        Path(str(self.gate) + ".ready").unlink(missing_ok=True)
        Path(str(self.gate) + ".pid").unlink(missing_ok=True)
        for p in self.status_dir.glob(f"{self.gate.name}.round-*"):
            p.unlink(missing_ok=True)
        env = worker_env(os.environ, self.head.token)
        env.update(cfg.env)
        env.update(
            SPOTCTL_ZYGOTE=self._zygote_socket(),
            SPOTCTL_RDZV_GATE=str(self.gate),
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
            SPOTCTL_NODE_ID=cfg.node_id,
            SPOTCTL_STATUS_DIR=str(self.status_dir),
            SPOTCTL_NOTICE_FILE=str(self.notice_path),
            SPOTCTL_CHECKPOINT_DIR=cfg.checkpoint_dir,
            SPOTCTL_CHECKPOINT_EVERY=str(cfg.checkpoint_every),
            SPOTCTL_CHECKPOINT_EVERY_S=str(cfg.checkpoint_every_s),
            SPOTCTL_KEEP_LAST=str(cfg.keep_last),
            SPOTCTL_CHECKPOINT_WRITERS=str(cfg.checkpoint_writers),
            SPOTCTL_MAX_STEPS=str(cfg.max_steps),
            # every rank of the cluster at its largest: micro_batch "auto" (spotctl.elastic)
            SPOTCTL_MAX_WORLD=str(max(1, cfg.max_nodes) * max(1, cfg.nproc_per_node)),
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            PYTHONUNBUFFERED="1",
        )
        if cfg.expect_gpus:
            # NCCL names the transport it picked at the first communicator (see netprobe)
            for p in self.status_dir.glob(netprobe.NCCL_FILE_GLOB):
                p.unlink(missing_ok=True)
            self._nccl_seen.clear()
            env.update(netprobe.nccl_env(env, self.status_dir))
            env.update(netprobe.efa_env(env, self.net))
        if self.worker is not None:
            self.worker.env(env)
        port = 0
        if cfg.engine == "torchft":
            port = spare_port(cfg.local_addr)
            env.update(SPOTCTL_ENGINE="torchft", TORCHFT_LIGHTHOUSE=cfg.lighthouse,
                       SPOTCTL_FT_REPLICA_ID=self.group["id"] if self.group else cfg.node_id,
                       SPOTCTL_FT_REPLICA_NODES=str(cfg.replica_nodes),
                       RUST_LOG=env.get("RUST_LOG", "warn"))
            # the replica's dense index, 0..N-1, the lowest free when it joined (a group of
            # several nodes: its id's number, g<N>); torchtitan's replica id
            index = self.group.get("index") if self.group else self.replica_index
            self.running_index = None if self.group else index
            if index is not None:
                env["SPOTCTL_FT_REPLICA_INDEX"] = str(index)
            else:
                env.pop("SPOTCTL_FT_REPLICA_INDEX", None)
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        log_path = self.workdir / "torchrun.log"
        out = open(log_path, "ab")
        self.torchrun = subprocess.Popen(
            torchrun_command(cfg, port, self.group), cwd=str(Path(cfg.script).parent), env=env,
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            **(self.worker.popen_kwargs() if self.worker else {}),
        )
        out.close()
        log.info("torchrun started (pid %s), gate %s", self.torchrun.pid,
                 "open" if self.gate.exists() else "closed")

    def _zygote_socket(self) -> str:
        """Start (or keep) the node's warm zygote; '' when it cannot run (cold starts)."""
        z = self.zygote
        if self.zygote_path is None:
            return ""
        if z is not None and z.poll() is None:
            return str(self.zygote_path)
        if z is not None:
            log.warning("zygote exited %s; starting a new one", z.returncode)
        self.zygote_path.unlink(missing_ok=True)
        env = worker_env(os.environ, self.head.token)
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
        # the spec's [train] env as well: what a process reads as it starts (the library
        # path, LD_PRELOAD, the CUDA allocator's settings) counts here, not in a forked
        # worker's os.environ
        env.update(self.cfg.env)
        if self.cfg.expect_gpus:  # the library path is read at process start
            env.update(netprobe.efa_env(env, self.net))
        if self.worker is not None:
            self.worker.env(env)
        log_f = open(self.workdir / "zygote.log", "ab")
        self.zygote = subprocess.Popen(
            [self.cfg.python or sys.executable, "-m", "spotctl.agent.zygote",
             str(self.zygote_path)], env=env, stdout=log_f, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=str(self.workdir),
            **(self.worker.popen_kwargs() if self.worker else {}),
        )
        log_f.close()
        # it binds its socket before importing anything heavy: a launcher started now
        # finds it (and waits in its backlog), rather than starting cold
        deadline = time.monotonic() + 5.0
        while not self.zygote_path.exists() and self.zygote.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        return str(self.zygote_path)

    def stop_torchrun(self, timeout_s: float = 15.0) -> int | None:
        tr = self.torchrun
        if tr is None:
            return None
        if tr.poll() is None:
            tr.send_signal(signal.SIGTERM)
            try:
                tr.wait(timeout_s)
            except subprocess.TimeoutExpired:
                tr.kill()
                tr.wait(5)
        # any worker that outlived torchrun (they run in their own sessions)
        self.signal_workers(signal.SIGKILL, self._live_workers(self.read_workers()))
        return tr.returncode

    def leave(self) -> None:
        """Stop torchrun without closing the rendezvous, then leave the rendezvous."""
        self._warm_up()  # a leave the head asked for, with no notice before it
        self.state = "leaving"
        self._heartbeat()
        pid = self.torchrun.pid if self.torchrun else None
        # Keep heartbeating while torchrun stops: a leaver silent for the head's
        # unresponsive timeout would be declared gone, and the survivors released before
        # it is out of the rendezvous (seen under load).
        done = threading.Event()

        def keep_alive() -> None:
            while not done.wait(1.0):
                self._heartbeat()

        beat = threading.Thread(target=keep_alive, name="leave-heartbeat", daemon=True)
        beat.start()
        try:
            self.stop_torchrun()
            if pid is not None:
                try:
                    ok = self._leave_rendezvous(pid)
                    log.info("left the rendezvous (%s)", "ok" if ok else "still listed")
                except Exception as e:  # the keep-alive expiry removes it anyway
                    log.warning("rendezvous leave failed: %s", e)
        finally:
            done.set()
            beat.join(5)
        self.torchrun = None
        self.state = "left"
        self._heartbeat()

    # -- main loop
    def _heartbeat(self, workers: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        body = {
            "node_id": self.cfg.node_id,
            "agent_state": self.state,
            "addr": self.cfg.local_addr,
            "workers": workers if workers is not None
            else self._present(self._live_workers(self.read_workers())),
            "drain_gen": self.drain_gen,
            "notice": self.notice,
            # torchrun is up and waiting at the rendezvous gate: the group may drain now
            "ready": self.state == "running" or Path(str(self.gate) + ".ready").exists(),
        }
        if self.error is not None:
            body["error"] = self.error
        if self.running_index is not None and self.torchrun is not None:
            body["replica_index"] = self.running_index
        if self.group_port:
            g = self.group
            grp: dict[str, Any] = {"size": self.cfg.replica_nodes, "port": self.group_port}
            if g is not None:
                grp.update(id=g["id"], gen=g["gen"], slot=g["slot"])
            elif self.group_broken is not None:
                grp.update(self.group_broken, broken=True)
            body["group"] = grp
        net_key = (self.head_id, self.nccl_transport)
        if self.net is not None and self._net_acked != net_key:
            body["net"] = dict(self.net, nccl_transport=self.nccl_transport)
        try:
            reply = self.head.heartbeat(body)
            self.head_errors = 0
        except HeadUnavailable as e:
            self.head_errors += 1
            if self.head_errors in (1, 10) or self.head_errors % 100 == 0:
                log.warning("heartbeat failed (%d in a row): %s", self.head_errors, e)
            return None
        if reply.get("head_id") != self.head_id:
            if self.head_id is not None:
                log.info("the head restarted: generations reset")
            self.head_id = reply.get("head_id")
            self.drain_gen = 0
            self.release_gen = reply.get("release_gen", 0)
            self.kill_gen = reply.get("kill_gen", 0)
        if "net" in body and reply.get("head_id") == net_key[0]:
            self._net_acked = net_key
        elif "net" in body:  # a head we had not told yet: tell it on the next beat
            self._net_acked = None
        return reply

    def _watch_nccl(self) -> None:
        """Every few seconds on a GPU node: the transport NCCL named in the workers' debug
        files (kept across restarts until a new one is named)."""
        now = time.monotonic()
        if not self.cfg.expect_gpus or now - self._nccl_checked < 2.0:
            return
        self._nccl_checked = now
        found = netprobe.nccl_transport_in(self.status_dir, self._nccl_seen)
        if found and found != self.nccl_transport:
            log.info("NCCL transport: %s", found)
            self.nccl_transport = found

    def _crashed(self, head_answered: bool, workers: list[dict[str, Any]]) -> bool:
        """Whether the workers just failed the same way for the CRASH_LIMIT-th time in a row
        (then torchrun is stopped and stays stopped: state "crashed"). Failures while the
        head does not answer are not counted (a head restarting fails them all alike).
        torchft: looked at when torchrun has failed (its workers may log a traceback of
        torchft's own and go on); torchrun: on every tick (it restarts its workers itself)."""
        if self.state not in ("running", "waiting") or self.notice is not None:
            return False
        tr = self.torchrun
        if self.cfg.engine == "torchft" and (tr is None or tr.poll() in (None, 0)):
            return False
        steps = [int(w.get("step") or 0) for w in workers]
        if not self.crash.look(max(steps) if steps else None, count=head_answered):
            return False
        self.error = self.crash.line
        log.error("the workers failed %d times in a row with: %s; not restarting them "
                  "(`spotctl down`, fix, `spotctl up`)", self.crash.count, self.error)
        if self.torchrun is not None:
            self.stop_torchrun()
            self.torchrun = None
        self.state = "crashed"
        self._heartbeat([])
        return True

    def step(self) -> None:
        every = self.read_workers()  # read once a tick: live ones report, all count steps
        workers = self._present(self._live_workers(every))
        self._watch_nccl()
        reply = self._heartbeat(workers)
        if reply is not None and reply.get("engine") == "torchrun" and self.cfg.engine == "torchft":
            self._switch_to_torchrun()
            return
        if self.state == "crashed" or self._crashed(reply is not None, every):
            return
        if self.state in ("waiting", "failed") and self.torchrun is None \
                and not self._gpus_ready():
            return
        tr = self.torchrun
        if tr is not None and tr.poll() is not None and self.state in ("running", "waiting"):
            code = tr.returncode
            if self.notice is not None and code != 0 and self.cfg.engine != "torchft":
                # the group broke while this node was leaving: its torchrun refused a new
                # round (spotctl.elastic.rdzv); take it out of the rendezvous at once
                log.info("torchrun exited %s with a notice pending: leaving", code)
                self.leave()
                return
            self.torchrun = None
            group, self.group = self.group, None
            if code == 0 and self.state == "running" and group is not None \
                    and any(w.get("phase") == "drained" for w in self.read_workers()):
                # another node of the replica group had a notice: the group left the quorum
                # together; this node waits for the group's next generation
                self.group_done = (group["id"], group["gen"])
                self.state = "waiting"
                log.info("replica group %s left the quorum (generation %s); waiting for "
                         "its next", group["id"], group["gen"])
            elif code == 0 and self.state == "running":
                self.state = "finished"
                log.info("training finished")
            else:
                if group is not None:
                    # the group's other nodes would wait for this one in a collective or a
                    # quorum: the head moves the group to a new generation, which restarts
                    # them all (told in the heartbeats until it has)
                    self.group_done = (group["id"], group["gen"])
                    self.group_broken = {k: group[k] for k in ("id", "gen", "slot")}
                # torchrun gives up when the store (head) is gone: come back when it is
                self.torchrun_restarts += 1
                self.next_start = time.monotonic() + min(5.0, 0.5 * self.torchrun_restarts)
                log.warning("torchrun exited %s; restarting when the head answers", code)
                self.state = "waiting"
        if self.cfg.engine == "torchft":
            self._step_ft(workers, reply)
            return
        if reply is None:
            return
        if self.state == "waiting" and self.notice is not None:
            if self.torchrun is not None:
                self.stop_torchrun()
                self.torchrun = None
            self.state = "left"
            return
        if self.state == "waiting":
            if self.torchrun is None and time.monotonic() >= self.next_start:
                # start early behind the closed gate: imports overlap the group's drain
                self.start_torchrun()
            if self.torchrun is not None and reply.get("go"):
                n = reply.get("start_nodes")
                if isinstance(n, int) and 0 < n <= MAX_ROUND_NODES:
                    # the first round's size (a start after a switch): as a drain's below
                    runas.touch(self.status_dir / f"{self.gate.name}.round-0-{n}")
                runas.touch(self.gate)
                self.state = "running"
            return
        if self.state != "running":
            return
        drain = reply.get("drain")
        if drain and drain["gen"] > self.drain_gen:
            self.drain_gen = drain["gen"]
            nodes = drain.get("nodes")
            if isinstance(nodes, int) and 0 < nodes <= MAX_ROUND_NODES:
                # the next round's size, for torchrun's handler (spotctl.elastic.rdzv): in a
                # file's name, so that nothing is written into a file the training user owns
                try:
                    runas.touch(self.status_dir / f"{self.gate.name}.round-{self.drain_gen}-{nodes}")
                except OSError as e:  # the round then waits torch's last call, as before
                    log.warning("next round's size: %s", e)
            # (SIGUSR1's default action kills: never to a plain script's workers)
            self.signal_workers(signal.SIGUSR1, [w for w in workers if w.get("route") != "plain"])
            plain = [w for w in workers if w.get("route") == "plain"]
            if plain:
                self._notice_plain(drain, plain)
        if reply.get("leave"):
            self.leave()
            return
        if reply.get("release_gen", 0) > self.release_gen:
            drained = [w for w in workers if w.get("phase") == "drained"]
            self.signal_workers(signal.SIGTERM, drained)
            self.release_gen = reply["release_gen"]
        if reply.get("kill_gen", 0) > self.kill_gen:
            inc = reply.get("kill_incarnation")
            doomed = [w for w in workers if w.get("incarnation") == inc]
            self.signal_workers(signal.SIGKILL, doomed)
            self.kill_gen = reply["kill_gen"]
        if not drain and self.plain_grace_end is not None:
            self._end_plain_notice()  # the round is over: the next one has no notice

    # -- plain torchrun scripts (spotctl.elastic.plain)
    def _notice_plain(self, drain: dict[str, Any], plain: list[dict[str, Any]]) -> None:
        """Tell a plain script's workers they must stop (the notice file), and when: after
        the grace, bounded by the drain's deadline and this node's notice."""
        now = time.time()
        end = now + self.notice_grace_s
        for dl, margin in ((drain.get("deadline"), TERM_DEADLINE_MARGIN_S),
                           ((self.notice or {}).get("deadline"), 2 * TERM_DEADLINE_MARGIN_S)):
            if isinstance(dl, (int, float)) and math.isfinite(dl):
                end = min(end, float(dl) - margin)
        end = max(end, now)
        body = {"reason": "notice" if self.notice is not None else "rescale",
                "deadline": round(end, 3), "id": f"{self.cfg.node_id}-{self.head_id}-{drain['gen']}"}
        self._write_notice_file(body)  # (if it fails, the grace still ends, with SIGTERM)
        self.plain_grace_end = end
        self.plain_noticed = {int(w.get("pid") or 0) for w in plain}
        log.info("notice to a plain script's workers (%s): SIGTERM in %.1fs at the latest",
                 body["reason"], end - now)

    def _write_notice_file(self, body: dict[str, Any]) -> None:
        """The notice file (SPOTCTL_NOTICE_FILE), whole or not at all."""
        tmp = self.notice_path.with_name(f".notice-{os.getpid()}.tmp")
        try:
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(body))
            os.replace(tmp, self.notice_path)
        except OSError as e:
            log.warning("notice file %s: %s", self.notice_path, e)

    def _present(self, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A plain script's noticed workers count as drained once their grace is over (the
        group then goes on to SIGTERM them); those that said so are already."""
        end = self.plain_grace_end
        if end is None or time.time() < end:
            return workers
        return [dict(w, phase="drained", drain_step=w.get("step"))
                if w.get("phase") == "train" and int(w.get("pid") or 0) in self.plain_noticed
                else w for w in workers]

    def _end_plain_notice(self) -> None:
        self.notice_path.unlink(missing_ok=True)
        self.plain_grace_end = None
        self.plain_noticed = set()

    def _switch_to_torchrun(self) -> None:
        """The head moved this torchft cluster onto the restart cycle (a plain torchrun
        script runs: one torchrun job across the nodes, never one copy per node)."""
        log.info("the head runs this job on the restart cycle (a plain torchrun script): "
                 "restarting torchrun as one job across the nodes")
        self.stop_torchrun()
        self.torchrun = None
        self.cfg.engine = "torchrun"
        self.cfg.replica_nodes = 1
        self.group = self.group_broken = None
        self.group_done = None
        self.group_port = 0
        self.replica_index = self.running_index = None
        self.next_start = 0.0
        self.state = "left" if self.notice is not None else "waiting"

    def _step_ft(self, workers: list[dict[str, Any]], reply: dict[str, Any] | None) -> None:
        """The torchft engine: no group drain, no gate. A replica starts training as soon
        as it is up (it recovers from a live peer; the others never pause), and a notice
        is this node's own graceful leave: its workers finish the agreed step, commit and
        leave the quorum; the head's drain/release/kill generations are not for it."""
        tr = self.torchrun
        if self.cfg.replica_nodes > 1 and self._group_moved(reply, workers):
            return
        if self.cfg.replica_nodes <= 1 and self._index_moved(reply):
            return
        b, now = self.group_broken, (reply or {}).get("group")
        if b is not None and reply is not None and (
                now is None or (now["id"], now["gen"]) != (b["id"], b["gen"])):
            self.group_broken = None  # the head has moved the group on
        if self.state == "waiting":
            if self.notice is not None:
                self.state = "left"
            elif tr is None and time.monotonic() >= self.next_start:
                if self.cfg.replica_nodes > 1:
                    g = (reply or {}).get("group")
                    if not g or not g.get("master") or self.group_done == (g["id"], g["gen"]):
                        return  # the group is not full yet (or not yet anew)
                    self.group = g
                    log.info("replica group %s generation %s: slot %s of %s", g["id"],
                             g["gen"], g["slot"], ", ".join(g["nodes"]))
                elif reply is not None and "replica_index" in reply:
                    if reply["replica_index"] is None:
                        return  # the head gives it once it has settled
                    self.replica_index = int(reply["replica_index"])
                self.start_torchrun()
                self.state = "running"
            return
        if self.state == "running" and (self.notice is not None or (reply or {}).get("leave")):
            # a notice, or the head asks (rebalance): the same graceful leave
            self.state = "leaving"
            dl = (self.notice or {}).get("deadline")
            if isinstance(dl, (int, float)) and math.isfinite(dl):
                # its lead, for diloco/localsgd's on_notice = "auto" (spotctl.elastic.ft:
                # train to the round's sync, or leave now and drop the round's local steps)
                self._write_notice_file({"reason": "notice",
                                         "deadline": round(dl - 2 * TERM_DEADLINE_MARGIN_S, 3),
                                         "id": f"{self.cfg.node_id}-{self.head_id}-leave"})
            self.signal_workers(signal.SIGUSR1, workers)
            self._heartbeat()
            return
        if self.state == "leaving" and (tr is None or tr.poll() is not None):
            self.torchrun = None
            self.state = "left"
            log.info("left the quorum")
            self._heartbeat()

    def _index_moved(self, reply: dict[str, Any] | None) -> bool:
        """This node's torchrun runs with a replica index the head has given to another
        node (this one was silent long enough to be counted gone): stopped, to start again
        with the index the head gives it now. Two live replicas never share an index (a
        torchft identity and, for torchtitan, a data shard)."""
        if reply is None or "replica_index" not in reply or self.state != "running" \
                or self.running_index is None:
            return False
        now = reply["replica_index"]
        if now is None or now == self.running_index:
            return False
        log.info("replica index %s is another node's now (this node was counted gone): "
                 "restarting torchrun with index %s", self.running_index, now)
        self.stop_torchrun()
        self.torchrun = None
        self.replica_index = int(now)
        self.running_index = None
        self.state = "waiting"
        return True

    def _group_moved(self, reply: dict[str, Any] | None,
                     workers: list[dict[str, Any]]) -> bool:
        """A replica group of several nodes whose torchrun runs for a generation the head
        has moved on from (a node of it is gone): stopped, to start again with the
        group's next generation. Not while its workers leave the quorum gracefully (they
        finish the step and the due checkpoint first, and exit by themselves)."""
        g = self.group
        if g is None or reply is None or self.state != "running":
            return False
        now = reply.get("group")
        if now is not None and (now["id"], now["gen"]) == (g["id"], g["gen"]):
            return False
        if any(w.get("phase") == "drained" for w in workers):
            return False
        log.info("replica group %s generation %s is over: stopping torchrun", g["id"], g["gen"])
        self.stop_torchrun()
        self.torchrun = None
        self.group = None
        self.state = "waiting"
        return True

    def run(self) -> int:
        threading.Thread(target=self._run_gpu_gate, name="gpu-gate", daemon=True).start()
        try:  # before the zygote: its environment takes the EFA plugin's (efa_env)
            self.net = netprobe.probe("/")
        except OSError as e:  # informational: never stops the node
            log.warning("network probe failed: %s", e)
        self._zygote_socket()  # warm up while we register
        self._start_monitors()
        # first contact takes the head's current generations (see _heartbeat)
        while not self._done() and self._heartbeat([]) is None:
            time.sleep(0.5)
        while not self._done():
            t0 = time.monotonic()
            try:
                self.step()
            except Exception:
                log.exception("agent step failed")
            if self.state == "finished":
                self._heartbeat([])
            self._stop.wait(max(0.0, TICK_S - (time.monotonic() - t0)))
        self.stop_torchrun()
        if self.zygote is not None and self.zygote.poll() is None:
            self.zygote.kill()
        if self._leaver is not None and self._leaver.poll() is None:
            self._leaver.kill()
        if self.zygote_path is not None:
            self.zygote_path.unlink(missing_ok=True)
            if self.zygote_path.parent.name.startswith("spotctl-"):  # mkdtemp's
                with contextlib.suppress(OSError):
                    self.zygote_path.parent.rmdir()
        return 0

    def stop(self) -> None:
        self._stop.set()

    def terminate(self) -> None:
        """SIGTERM: the OS stops the agent. Mostly that means stop now; but on GCP a Spot
        VM's preemption *is* an ACPI soft-off, and systemd stops this unit at the notice
        itself, 30 s before the VM goes: stopping then would throw the graceful leave
        away (the drain, the commit, the leave of the rendezvous or the quorum). So with
        a notice (or, on GCP, one within TERM_NOTICE_WAIT_S) the agent goes on until its
        node has left, at the latest until shortly before the notice's deadline."""
        if self._term_at is None:
            self._term_at = time.time()

    def _done(self) -> bool:
        """Whether the main loop ends now (stop(), or terminate() as above). Only a node
        whose notices are GCP's (or the local emulator's, which plays GCP's soft-off)
        waits: elsewhere SIGTERM comes from spotctl itself (`down` on ssh hosts) or, on
        AWS, at the deadline."""
        if self._stop.is_set():
            return True
        t = self._term_at
        if t is None:
            return False
        if self.cfg.metadata not in ("gcp", "local"):
            return True
        now, n = time.time(), self.notice
        if n is None:
            return now - t >= TERM_NOTICE_WAIT_S
        if self.state in ("left", "finished", "failed", "crashed"):
            return True
        if not self._term_logged:
            self._term_logged = True
            log.info("SIGTERM with a notice: leaving first (at the latest %.1f s from now)",
                     float(n["deadline"]) - TERM_DEADLINE_MARGIN_S - now)
        return now >= float(n["deadline"]) - TERM_DEADLINE_MARGIN_S


def _grace(v: str | None) -> float:
    """SPOTCTL_NOTICE_GRACE_S: seconds, 0..MAX_NOTICE_GRACE_S (anything else: the default,
    with a warning)."""
    if v is None:
        return NOTICE_GRACE_S
    try:
        g = float(v)
    except ValueError:
        g = -1.0
    if not 0 <= g <= MAX_NOTICE_GRACE_S:
        log.warning("SPOTCTL_NOTICE_GRACE_S=%r is not a number of seconds within 0..%g: %g",
                    v, MAX_NOTICE_GRACE_S, NOTICE_GRACE_S)
        return NOTICE_GRACE_S
    return g


def worker_env(environ: Mapping[str, str], token: str) -> dict[str, str]:
    """The environment training processes start from: the agent's, less any credential of
    the cluster (a variable holding the node token, or named like spotctl's token)."""
    return {k: v for k, v in environ.items()
            if not (token and token in v) and not k.upper().startswith("SPOTCTL_TOKEN")}


def run_agent(config_path: Path) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(message)s")
    cfg = AgentConfig.load(config_path)
    agent = Agent(cfg)
    signal.signal(signal.SIGTERM, lambda *_: agent.terminate())
    # SIGINT: stop now, notice or not (a local cluster's `down`)
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    return agent.run()
