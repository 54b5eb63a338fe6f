"""A local cluster driven through the real CLI (subprocesses), as a user would; its\nstatus and events are polled in-process with the CLI's own code (see `status`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotctl.agent import proctree
from spotctl.elastic.checkpoint import COMMIT, committed_steps, open_store

from .replays import Window

REPO = Path(__file__).resolve().parents[2]
SPOTCTL = [sys.executable, "-m", "spotctl.cli.app"]


class Timeout(AssertionError):
    pass


def _in_section(extra: str, section: str, line: str) -> str:
    """`extra` with `line` first in its `[section]`, which is added when it has none."""
    head = f"[{section}]\n"
    if head in extra:
        return extra.replace(head, head + line, 1)
    return extra + "\n" + head + line


def harness_toml(extra: str) -> str:
    """`extra` (spec TOML after [train]) as a harness runs it:
    - `[rebalance] on_head = false`: only what a scenario does (its own `rebalance`,
      `up`) replaces nodes, never the head's loop racing what it checks;
    - `[local] private_network = false` (unless it says otherwise): the harness reads the
      cluster's head and listeners from its own process, which needs them on this
      machine's loopback (spotctl.providers.local.private; its own tests ask for one)."""
    extra = _in_section(extra, "rebalance", "on_head = false\n")
    if "private_network" in extra or "netns" in extra:
        return extra
    return _in_section(extra, "local", "private_network = false\n")


class Cluster:
    def __init__(
        self,
        root: Path,
        name: str,
        gpus: str,
        checkpoint_every: int,
        train_env: dict[str, str] | None = None,
        extra_toml: str = "",
        engine: str = "torchrun",
        script: Path | None = None,
    ):
        """engine: the spec's `[train] engine` (always written). script: the training
        script (default: templates/train.py); the template is copied as train.py either
        way, so a script may import it."""
        self.root, self.name, self.every = root, name, checkpoint_every
        self.engine = engine
        self.checkpoint_dir: Path | None = None  # set when the spec names one
        self.home = root / "home"
        self.project = root / "project"
        self.project.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "templates" / "train.py", self.project / "train.py")
        if script is not None:
            shutil.copy(script, self.project / script.name)
        script_name = script.name if script is not None else "train.py"
        self.env = dict(os.environ, SPOTCTL_HOME=str(self.home), NO_COLOR="1")
        self._store: Any = None  # the journal (state.db), opened on the first poll
        env = {"TRAIN_STEP_SLEEP_S": "0.05"}
        # the workers' own step records on torchrun: the template's sample trace, which
        # the fault matrix counts replayed steps from (scripts/chaos_lib/replays.py)
        self.trace_dir: Path | None = None
        if engine == "torchrun" and script is None:
            self.trace_dir = root / "samples"
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            env["SPOTCTL_TRACE_SAMPLES"] = str(self.trace_dir)
        env |= train_env or {}
        env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
        (self.project / "spotctl.toml").write_text(
            f'name = "{name}"\nprovider = "local"\ngpus = "{gpus}"\n\n'
            f'[train]\nengine = "{engine}"\nscript = "{script_name}"\n'
            f"checkpoint_every = {checkpoint_every}\n"
            f"env = {{ {env_toml} }}\n{harness_toml(extra_toml)}\n"
        )

    # -- the CLI
    def cli(
        self, *args: str, check: bool = True, timeout: float = 240
    ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            [*SPOTCTL, *args],
            cwd=self.project,
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        if check and p.returncode != 0:
            raise AssertionError(
                f"spotctl {' '.join(args)} exited {p.returncode}: {p.stderr[-2000:]}"
            )
        return p

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*SPOTCTL, *args],
            cwd=self.project,
            env=self.env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def up(self, wait: float = 150) -> None:
        self.cli("up", "--wait", str(wait), timeout=wait + 90)

    # `status --json` and `events --json`, computed in this process by the same code the
    # CLI runs (sync the head's events into the journal, then read): the waits poll them
    # every 0.4 s, and a new CLI process per poll took a good part of a core away from
    # the cluster under test on a 2-core machine. Actions still go through the CLI.
    def _journal(self) -> Any:
        from spotctl.state import Store

        if self._store is None:
            self._store = Store(self.home)
        return self._store

    def status(self) -> dict[str, Any]:
        from spotctl.control.status import status_json

        try:
            return status_json(self._journal(), self.name)
        except Exception as e:  # noqa: BLE001 - what a failing `spotctl status` would be
            raise AssertionError(f"status: {type(e).__name__}: {e}") from e

    def events(self, type_: str | None = None) -> list[dict[str, Any]]:
        from spotctl.control.status import events_json

        try:
            return events_json(self._journal(), self.name, type_)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"events: {type(e).__name__}: {e}") from e

    def node_events(self, type_: str, node: str, skip: int = 0,
                    timeout: float = 15) -> list[dict[str, Any]]:
        """`node`'s events of `type_` after the first `skip` of that type, waiting up to
        `timeout` s for one (the head's liveness window is 4 s: on torchft the quorum can
        re-form before the head has called a silent node unresponsive)."""
        deadline = time.monotonic() + timeout
        while True:
            got = [e for e in self.events(type_)[skip:] if e.get("node") == node]
            if got or time.monotonic() > deadline:
                return got
            time.sleep(0.5)

    def wait_for(
        self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 150
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                st = self.status()
            except AssertionError:
                st = {}
            if st and pred(st):
                return st
            time.sleep(0.4)
        raise Timeout(
            f"timed out waiting for {what}; last: world={st.get('world_size')} "
            f"step={st.get('step')}\n{self.debug()}"
        )

    def training(self, world: int, past: int = 0, timeout: float = 150) -> dict[str, Any]:
        """Wait until the job trains at `world` beyond step `past`."""
        return self.wait_for(
            f"world {world} past step {past}",
            lambda s: s["world_size"] == world and s["step"] > past,
            timeout,
        )

    # -- nodes and processes
    @property
    def cluster_dir(self) -> Path:
        return self.home / "clusters" / self.name

    @property
    def ckpt_dir(self) -> Path:
        return self.checkpoint_dir or self.cluster_dir / "checkpoints"

    def vm(self, node: str) -> dict[str, Any]:
        return json.loads((self.cluster_dir / "nodes" / node / "vm.json").read_text())

    def live_nodes(self) -> list[str]:
        """Nodes whose VM process runs (the local "cloud"'s truth)."""
        out = []
        for d in sorted((self.cluster_dir / "nodes").glob("n*")):
            try:
                vm = json.loads((d / "vm.json").read_text())
            except (OSError, ValueError):
                continue
            if vm.get("state") in ("running", "pending") and proctree.tagged(self.tag(d.name)):
                out.append(d.name)
        return out

    def serving_nodes(self) -> tuple[list[str], set[str]]:
        """(live nodes that have not left the job, the nodes that left or are draining): a
        node from an earlier notice may still run until its hard stop."""
        gone = {n["id"] for n in self.status()["nodes"] if n["state"] in ("left", "draining")}
        return [n for n in self.live_nodes() if n not in gone], gone

    def worker_pids(self) -> dict[str, int]:
        """Each node's rank-0 worker process, from its own report (status/worker-0.json)."""
        out = {}
        for p in sorted(self.cluster_dir.glob("nodes/n*/status/worker-0.json")):
            try:
                out[p.parent.parent.name] = int(json.loads(p.read_text())["pid"])
            except (OSError, ValueError, KeyError):
                pass
        return out

    def failed_steps(self) -> dict[str, int]:
        """torchft: each node's count of step attempts that failed the commit vote (and ran
        again), from its rank-0 worker's own report (status/worker-0.json). A replica's
        count starts at 0 with its process: compare a node's counts within one process."""
        out = {}
        for p in sorted(self.cluster_dir.glob("nodes/n*/status/worker-0.json")):
            try:
                out[p.parent.parent.name] = int(json.loads(p.read_text()).get("failed_steps") or 0)
            except (OSError, ValueError):
                continue
        return out

    def training_nodes(self) -> list[str]:
        st = self.status()
        return [n["id"] for n in st["nodes"] if n["state"] == "running" and n.get("step")]

    def tag(self, node: str) -> str:
        return f"{self.cluster_dir}/{node}"

    def node_pids(self, node: str) -> list[int]:
        return proctree.tagged(self.tag(node))

    def processes(self) -> list[int]:
        return proctree.tagged_prefix(str(self.cluster_dir) + "/")

    def signal_node(self, node: str, sig: int) -> list[int]:
        pids = self.node_pids(node)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def kill_head(self) -> list[int]:
        pids = proctree.tagged(self.tag("head"))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def replay_window(self) -> Window | None:
        """A mark in the workers' trace, to count the replays since (None: the workers
        write none, as on torchft, whose replicas log their own steps)."""
        return Window.open(self.trace_dir) if self.trace_dir is not None else None

    # -- checkpoints
    def committed(self) -> list[int]:
        return committed_steps(self.ckpt_dir)

    def uncommitted(self) -> list[int]:
        """Steps whose save has begun (its directory exists) and has no COMMIT yet."""
        return sorted(s for s, done in open_store(self.ckpt_dir).steps().items() if not done)

    def committed_before(self, t: float) -> int:
        """Newest step committed before wall time t (COMMIT's mtime)."""
        best = 0
        for s in self.committed():
            try:
                if (self.ckpt_dir / f"step-{s:08d}" / COMMIT).stat().st_mtime <= t:
                    best = max(best, s)
            except OSError:
                continue
        return best

    def debug(self) -> str:
        out = []
        for p in sorted(self.cluster_dir.glob("nodes/*/*.log")) + [
            self.cluster_dir / "head" / "head.log"
        ]:
            if p.exists():
                lines = [
                    x
                    for x in p.read_text(errors="replace").splitlines()
                    if "registry.py" not in x and x.strip()
                ]
                out.append(f"--- {p.relative_to(self.cluster_dir)}\n" + "\n".join(lines[-8:]))
        return "\n".join(out)[-6000:]

    def down(self) -> list[str]:
        leaks: list[str] = []
        if (self.home / "state.db").exists():
            p = self.cli("down", "--name", self.name, "--yes", "--json", check=False)
            if p.returncode != 0:
                leaks.append(f"down: {p.stderr.strip()[-300:]}")
        left = self.processes()
        if left:
            leaks.append(f"processes left after down: {left}")
            proctree.signal_all(left, 9)
        if self._store is not None:
            self._store.close()
            self._store = None
        return leaks
