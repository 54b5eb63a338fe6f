"""A real local cluster driven through the real CLI (subprocesses), torchrun and gloo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spotctl.agent import proctree

REPO = Path(__file__).resolve().parents[2]
SPOTCTL = [sys.executable, "-m", "spotctl.cli.app"]


class LocalCluster:
    def __init__(self, tmp: Path, name: str, env_extra: dict[str, str] | None = None):
        self.tmp = tmp
        self.name = name
        self.home = tmp / "home"
        self.project = tmp / "project"
        self.project.mkdir(parents=True, exist_ok=True)
        self.trace_dir = tmp / "samples"
        self.trace_dir.mkdir(exist_ok=True)
        shutil.copy(REPO / "templates" / "train.py", self.project / "train.py")
        self.env = dict(os.environ, SPOTCTL_HOME=str(self.home), NO_COLOR="1")
        self.env.update(env_extra or {})

    def write_spec(self, gpus: str, checkpoint_every: int = 20, train_env: dict[str, str] | None = None,
                   extra: str = "") -> None:
        env = {"SPOTCTL_TRACE_SAMPLES": str(self.trace_dir), "TRAIN_STEP_SLEEP_S": "0.05"}
        env.update(train_env or {})
        env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
        (self.project / "spotctl.toml").write_text(
            f'name = "{self.name}"\nprovider = "local"\ngpus = "{gpus}"\n\n'
            f'[train]\nscript = "train.py"\ncheckpoint_every = {checkpoint_every}\n'
            f"env = {{ {env_toml} }}\n{extra}\n"
        )

    def cli(self, *args: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([*SPOTCTL, *args], cwd=self.project, env=self.env, text=True,
                           capture_output=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"spotctl {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
        return p

    def status(self) -> dict[str, Any]:
        return json.loads(self.cli("status", "--name", self.name, "--json").stdout)

    def events(self, type_: str | None = None) -> list[dict[str, Any]]:
        args = ["events", "--name", self.name, "--json"]
        if type_:
            args += ["--type", type_]
        return json.loads(self.cli(*args).stdout)

    def wait_for(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            st = self.status()
            if pred(st):
                return st
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; last status: {json.dumps(st)[:3000]}\n"
                             f"{self.debug()}")

    def wait_event(self, type_: str, count: int = 1, timeout: float = 120) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        evs: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            evs = self.events(type_)
            if len(evs) >= count:
                return evs
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {count} {type_} event(s): {evs}\n{self.debug()}")

    def steps_advance(self, world: int, by: int = 5, timeout: float = 120) -> dict[str, Any]:
        first = self.wait_for(f"world size {world}", lambda s: s["world_size"] == world, timeout)
        return self.wait_for(f"step to advance past {first['step'] + by} at world {world}",
                             lambda s: s["world_size"] == world and s["step"] >= first["step"] + by,
                             timeout)

    def assert_one_world(self, st: dict[str, Any]) -> None:
        """No split brain: every training node is in the same worker group, whose world
        size counts exactly those nodes' GPUs."""
        running = [n for n in st["nodes"] if n["state"] == "running"]
        groups = {tuple(n["incarnations"]) for n in running}
        assert len(groups) == 1 and len(next(iter(groups))) == 1, f"split brain: {running}"
        assert st["world_size"] == sum(n["gpus"] for n in running), st

    @property
    def cluster_dir(self) -> Path:
        return self.home / "clusters" / self.name

    def processes(self) -> list[int]:
        return proctree.tagged_prefix(str(self.cluster_dir) + "/")

    def debug(self) -> str:
        out = []
        for p in sorted(self.cluster_dir.glob("nodes/*/*.log")) + [self.cluster_dir / "head" / "head.log"]:
            if p.exists():
                lines = [x for x in p.read_text(errors="replace").splitlines() if "registry.py" not in x]
                out.append(f"--- {p.relative_to(self.cluster_dir)}\n" + "\n".join(lines[-15:]))
        return "\n".join(out)

    def teardown(self) -> None:
        if (self.home / "state.db").exists():
            self.cli("down", "--name", self.name, "--yes", check=False)
        proctree.signal_all(self.processes(), 9)


@pytest.fixture
def local_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    made: list[LocalCluster] = []

    def make(name: str = "e2e", **kw: Any) -> LocalCluster:
        c = LocalCluster(tmp_path / name, name, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.teardown()
