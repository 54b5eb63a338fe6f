"""What every test directory shares, in one place.

- a network guard: a test that opens a connection (or resolves a name) beyond loopback and
  the local provider's network namespaces fails, naming the address
- `free_port()`, `wait_until()`: a free loopback port; poll a condition with a deadline
- `spotctl_home` / `home`: a fresh state dir in SPOTCTL_HOME, no test seam left set
- `run_cli`: the typer app in-process (CliRunner), with that state dir; `cli_main`: the
  same through `main` (exit codes and error lines as a user gets them)
- `ENGINES`: parametrize a cluster test over `[train] engine` (torchft skipped where the
  `ft` extra is not installed)
- `CliProject`: a project dir with spotctl.toml + train.py and the real CLI run in it as a
  subprocess (the up -> train -> down harness); `LocalCluster` / `local_cluster` on it
- `CloudFlow` / `cloud_flow`: the same on aws or gcp pointed at a fake, every instance's
  SSH sent to one loopback sshd, notices from `MetadataRouter` (per-node metadata
  emulators); the fakes themselves are the provider conftests' (`aws_flow`, `gcp_flow`)
- real OpenSSH sshd on loopback (`Sshd`, `SshdFactory`, `client_key`, `sshd_factory`,
  `sshd`) and the real head as a child process (`Head`, `head`)
- `metadata_server`: a factory for the local metadata emulator (AWS IMDSv2 + GCP)
- after every slow test, any process still naming its tmp_path is killed (a cluster a
  failed test left), with a warning
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from spotctl.sockets import SPARE_LOW

REPO = Path(__file__).resolve().parents[1]
SPOTCTL = [sys.executable, "-m", "spotctl.cli.app"]
# moto's console output and the fake GCP's guest attributes publish no SSH host keys
# unless a test puts some there: a fresh VM's keys are waited for this long, not 150 s
# (tests/unit/test_host_key_wait.py checks the wait itself)
os.environ.setdefault("SPOTCTL_HOST_KEY_WAIT_S", "0.3")
SSHD = "/usr/sbin/sshd"
T = TypeVar("T")
# `@pytest.mark.parametrize("engine", ENGINES)`: a cluster test on both engines (issue 17)
ENGINES = [
    "torchrun",
    pytest.param("torchft", marks=pytest.mark.skipif(
        importlib.util.find_spec("torchft") is None,
        reason="torchft is not installed (the 'ft' extra)")),
]

# --- the network guard ----------------------------------------------------------------------

# Loopback, and 10.213.0.0/16: the addresses spotctl.providers.local.net gives the network
# namespaces a test makes (`[local] netns = true`).
ALLOWED_NETS = [
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
    ipaddress.ip_network("10.213.0.0/16"),
]
_violations: list[str] = []
_lock = threading.Lock()


class NetworkGuardError(ConnectionRefusedError):
    """A test tried to reach beyond loopback and its own namespaces."""


def _allowed_host(host: object) -> bool:
    if host is None or host == "":
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    name = str(host).split("%")[0]
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return name in ("localhost", socket.gethostname()) or name.endswith(".localhost")
    if ip.is_unspecified:
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in n for n in ALLOWED_NETS)


def _deny(what: str) -> NetworkGuardError:
    with _lock:
        _violations.append(what)
    return NetworkGuardError(f"tests may not reach the network: {what}")


def _install_network_guard() -> None:
    cls = socket.socket
    if getattr(cls, "_spotctl_guarded", False):
        return
    connect, connect_ex, sendto = cls.connect, cls.connect_ex, cls.sendto
    getaddrinfo = socket.getaddrinfo

    def check(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _allowed_host(address[0]):
            raise _deny(f"connect to {address!r}")

    def g_connect(self: socket.socket, address: Any) -> None:
        check(self, address)
        connect(self, address)

    def g_connect_ex(self: socket.socket, address: Any) -> int:
        check(self, address)
        return connect_ex(self, address)

    def g_sendto(self: socket.socket, data: Any, *args: Any) -> int:
        check(self, args[-1])
        return sendto(self, data, *args)  # type: ignore[arg-type]

    def g_getaddrinfo(host: Any, *args: Any, **kw: Any) -> Any:
        if not _allowed_host(host):
            raise _deny(f"resolve {host!r}")
        return getaddrinfo(host, *args, **kw)

    cls.connect = g_connect  # type: ignore[method-assign]
    cls.connect_ex = g_connect_ex  # type: ignore[method-assign]
    cls.sendto = g_sendto  # type: ignore[method-assign,assignment]
    socket.getaddrinfo = g_getaddrinfo
    cls._spotctl_guarded = True  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    _install_network_guard()


# The slow set runs in two workers, one file at a time each (.ci/run: -n 2 --dist
# loadfile): the longest files go first, so the run does not end with one worker waiting
# on a long file started last. Order only; every file still runs.
LONG_FIRST = (  # by their time alone, longest first (a serial run of the slow set)
    "tests/faults/test_fault_matrix.py",
    "tests/bench/test_bench_smoke.py",
    "tests/e2e/test_rescale.py",
    "tests/integration/test_checkpoint.py",
    "tests/aws/test_up_flow.py",
    "tests/ssh/test_cleanroom_pythons.py",
    "tests/elastic/test_ft_groups.py",
    "tests/gcp/test_up_flow.py",
    "tests/ssh/test_cleanroom.py",
    "tests/e2e/test_network_partition.py",
    "tests/elastic/test_timed_checkpoints.py",
    "tests/e2e/test_s3_checkpoints.py",
    "tests/elastic/test_rescale_state.py",
    "tests/examples/test_examples.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {f: i for i, f in enumerate(LONG_FIRST)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(rank)))


@pytest.fixture(autouse=True)
def _no_network() -> Iterator[None]:
    """Fail the test if it (or a thread it started) tried to reach beyond loopback, even
    when the code under test caught the error."""
    with _lock:
        _violations.clear()
    yield
    with _lock:
        seen, _violations[:] = list(_violations), []
    if seen:
        pytest.fail("test reached beyond loopback: " + "; ".join(seen[:5]), pytrace=False)


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return sum(v) - idle, sum(v)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With SPOTCTL_TEST_CPU_LOG=FILE, append one JSON line per test: its wall time and how
    busy the whole machine's CPUs were meanwhile (setup, call and teardown), so a run can
    tell tests that wait from tests that compute (which ones may share the CPUs)."""
    path = os.environ.get("SPOTCTL_TEST_CPU_LOG")
    if not path:
        yield
        return
    t0, (b0, n0) = time.monotonic(), _cpu_ticks()
    yield
    (b1, n1), wall = _cpu_ticks(), time.monotonic() - t0
    hz = os.sysconf("SC_CLK_TCK")
    line = {"test": item.nodeid, "wall_s": round(wall, 2), "cpu_s": round((b1 - b0) / hz, 2),
            "busy": round((b1 - b0) / max(1, n1 - n0), 3)}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


@pytest.fixture(autouse=True)
def _no_cluster_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a slow test, kill whatever process still mentions the test's own directory (a
    local cluster, a head, an agent a failed test never brought down), so one failure does
    not load the rest of the run; a warning names what was killed. Set up before the
    test's own fixtures, so it runs after their teardown (a `down` that did its job leaves
    nothing here). Module fixtures' clusters live in other directories."""
    if request.node.get_closest_marker("slow") is None or "tmp_path" not in request.fixturenames:
        yield
        return
    root = request.getfixturevalue("tmp_path")
    yield
    left = kill_procs_mentioning(root)
    if left:
        import warnings

        warnings.warn(f"{request.node.nodeid} left {len(left)} processes: killed {left[:10]}",
                      stacklevel=1)


# --- small helpers --------------------------------------------------------------------------


def last_char_changed(s: str) -> str:
    """`s` with its last character replaced by a different one (a forged MAC: replacing it
    with a fixed "0" leaves it valid whenever it already ended in 0, 1 run in 16)."""
    return s[:-1] + ("1" if s.endswith("0") else "0")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


PORT_SLICE = 1000  # ports per xdist worker
PORT_BASE = 5000  # gw0's slice starts here; ten slices end below spotctl's SPARE_LOW
_handed: list[int] = []  # ports this process handed out lately, maybe not bound yet


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (nobody listens on it). Picked below
    the kernel's ephemeral range, where outgoing connections take their source ports, and
    below `spotctl.sockets.SPARE_LOW`, where spotctl's own processes pick the ports they
    bind later (a local head, an agent's group port), so that neither can take it before
    this test binds it; from a slice of its own per xdist worker (gw0: 5000-5999, gw1:
    6000-6999, ...), so two workers never pick the same; and none this process handed out
    among its last 200, so two picks of one test that are not bound yet differ. bind(0)
    where the ephemeral range leaves no room."""
    import random

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    k = int(worker[2:]) if worker[2:].isdigit() else 0
    start = PORT_BASE + k * PORT_SLICE
    if start + PORT_SLICE <= min(_ephemeral_low(), SPARE_LOW):
        for port in random.sample(range(start, start + PORT_SLICE), 50):
            if port in _handed:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed.append(port)
            del _handed[:-200]
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def documented_median(metric_prefix: str) -> float:
    """The median of the docs' figure (docs/figures/bench-results.json, the table in
    docs/benchmarks.md) whose metric starts with `metric_prefix`: slow tests bound what
    they measure by a multiple of it, so the bound moves with the figure it guards."""
    return float(documented_row(metric_prefix)["spotctl"]["median"])


def documented_row(metric_prefix: str) -> dict[str, Any]:
    """The docs' row (docs/figures/bench-results.json) whose metric starts with
    `metric_prefix`: its `spotctl` and `baseline` figures come from the same run."""
    rows = json.loads((REPO / "docs" / "figures" / "bench-results.json").read_text())["rows"]
    found = [r for r in rows if r["metric"].startswith(metric_prefix)]
    assert len(found) == 1, f"{len(found)} documented figures named {metric_prefix!r}"
    return dict(found[0])


def documented_ratio(metric_prefix: str) -> float:
    """spotctl's median over its baseline's in the docs' row named by `metric_prefix`, both
    from one run: a slow test bounds the same ratio, measured side by side in one run, so
    the machine's load cancels out of the bound."""
    row = documented_row(metric_prefix)
    assert "baseline_run" not in row, f"{metric_prefix!r}: its baseline is from another run"
    return float(row["spotctl"]["median"]) / float(row["baseline"]["median"])


def wait_until(
    pred: Callable[[], T], timeout: float, what: str, interval: float = 0.2,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll `pred` until it returns something truthy (returned); AssertionError naming
    `what` (and the last value) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() > deadline:
            extra = on_timeout() if on_timeout else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; "
                                 f"last: {str(last)[:2000]}\n{extra}")  # fmt: skip
        time.sleep(interval)


# Environment seams a test sets for the process under test; none leaks into the next test.
SEAMS = (
    "SPOTCTL_GCP_ENDPOINT",
    "SPOTCTL_SSH_OVERRIDE",
    "SPOTCTL_SSH_OVERRIDE_KEY",
    "SPOTCTL_HEAD_PORTS",
    "SPOTCTL_SSH_REMOTE_ROOT",
    "SPOTCTL_METADATA_URL",
    "SPOTCTL_CRONTAB",
)


@pytest.fixture
def spotctl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh state dir (not created: spotctl makes it) in SPOTCTL_HOME for this test."""
    home = tmp_path / "home"
    monkeypatch.setenv("SPOTCTL_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "200")  # in-process tables: one width, whatever the runner's
    for k in SEAMS:
        monkeypatch.delenv(k, raising=False)
    return home


@pytest.fixture
def home(spotctl_home: Path) -> Path:
    return spotctl_home


@pytest.fixture
def run_cli(spotctl_home: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Invoke the typer app in-process: run_cli("prices", "-p", "gcp", "--json")."""
    from typer.testing import CliRunner

    from spotctl.cli.app import app

    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    runner = CliRunner()

    def run(*args: str, input: str | None = None) -> Any:
        return runner.invoke(app, list(args), input=input)

    return run


def cli_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI in this process through spotctl.cli.app.main (its error mapping and exit
    codes, unlike `run_cli`): (exit code, stdout, stderr)."""
    from spotctl.cli.app import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# --- the real CLI in a project dir: up -> train -> down -------------------------------------


class CliProject:
    """A project dir (train.py from templates/, spotctl.toml written by the test) and the
    real CLI run in it as a subprocess with its own SPOTCTL_HOME."""

    def __init__(self, tmp: Path, name: str, env_extra: dict[str, str] | None = None):
        self.tmp = tmp
        self.name = name
        self.home = tmp / "home"
        self.project = tmp / "project"
        self.project.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "templates" / "train.py", self.project / "train.py")
        self.env = dict(os.environ, SPOTCTL_HOME=str(self.home), NO_COLOR="1")
        # a pipe's full-width tables (PIPE_WIDTH), whatever the runner's COLUMNS: an 80
        # column one cut a rescale's details short when a long event type widened the
        # type column (seen under pytest-xdist)
        self.env.pop("COLUMNS", None)
        self.env.update(env_extra or {})

    def debug(self) -> str:
        return ""

    def cli(self, *args: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([*SPOTCTL, *args], cwd=self.project, env=self.env, text=True,
                           capture_output=True, timeout=timeout)  # fmt: skip
        if check and p.returncode != 0:
            raise AssertionError(f"spotctl {' '.join(args)} exited {p.returncode}:\n"
                                 f"{p.stdout}\n{p.stderr}\n{self.debug()}")  # fmt: skip
        return p

    # in_process: what `spotctl status --json` and `spotctl events --json` print, computed
    # in this process (under the project's environment) by the functions those commands
    # call. The harness polls them every 0.5 s, and a CLI process per poll (0.25 CPU-s of
    # start-up; 1.5 with the GCP client's imports) took about a third of the machine's busy
    # CPU-seconds from a cluster test. Tests about the commands run them through `cli`.
    in_process = False

    def status(self) -> dict[str, Any]:
        if not self.in_process:
            return dict(json.loads(self.cli("status", "--name", self.name, "--json").stdout))
        from spotctl.control.status import status_json

        with self._journal() as store:
            return status_json(store, self.name)

    def events(self, type_: str | None = None) -> list[dict[str, Any]]:
        if not self.in_process:
            args = ["events", "--name", self.name, "--json"]
            return list(json.loads(self.cli(*args, *(["--type", type_] if type_ else [])).stdout))
        from spotctl.control.status import events_json

        with self._journal() as store:
            return events_json(store, self.name, type_)

    @contextlib.contextmanager
    def _journal(self) -> Iterator[Any]:
        """The project's state dir, opened here with os.environ = the CLI's environment."""
        from spotctl.state import Store

        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env)
        store = None
        try:
            store = Store(self.home)
            yield store
        finally:
            if store is not None:
                store.close()
            os.environ.clear()
            os.environ.update(saved)

    def wait_for(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 120,
                 interval: float = 0.5) -> dict[str, Any]:  # fmt: skip
        last: list[dict[str, Any]] = [{}]

        def check() -> dict[str, Any] | None:
            last[0] = self.status()
            return last[0] if pred(last[0]) else None

        return wait_until(check, timeout, what, interval,
                          lambda: f"last status: {json.dumps(last[0])[:3000]}\n{self.debug()}")  # fmt: skip

    def wait_event(self, type_: str, count: int = 1, timeout: float = 120,
                   where: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:  # fmt: skip
        """Wait for `count` events of `type_` (those `where` accepts, when given)."""
        def check() -> list[dict[str, Any]] | None:
            evs = [e for e in self.events(type_) if where is None or where(e)]
            return evs if len(evs) >= count else None

        return wait_until(check, timeout, f"{count} {type_} event(s)", 0.5,
                          lambda: f"{self.events(type_)}\n{self.debug()}")  # fmt: skip


class LocalCluster(CliProject):
    """A real local cluster (head, agents, torchrun, gloo workers) driven through the CLI."""

    in_process = True

    def __init__(self, tmp: Path, name: str, env_extra: dict[str, str] | None = None):
        super().__init__(tmp, name, env_extra)
        self.trace_dir = tmp / "samples"
        self.trace_dir.mkdir(exist_ok=True)

    def write_spec(self, gpus: str, checkpoint_every: int = 20, train_env: dict[str, str] | None = None,
                   extra: str = "", engine: str = "torchrun") -> None:  # fmt: skip
        """spotctl.toml; `extra` goes on inside [train] (or opens sections of its own);
        `engine`: `[train] engine`, always written ("" writes none: the spec's default).
        `[rebalance] on_head = false`: a test that acts and then checks what followed must
        not race a replacement it did not ask for (the head's loop: test_cli_no_name.py)."""
        env = {"SPOTCTL_TRACE_SAMPLES": str(self.trace_dir), "TRAIN_STEP_SLEEP_S": "0.05"}
        env.update(train_env or {})
        env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
        engine_toml = f'engine = "{engine}"\n' if engine else ""
        from scripts.chaos_lib.cluster import harness_toml

        extra = harness_toml(extra)
        (self.project / "spotctl.toml").write_text(
            f'name = "{self.name}"\nprovider = "local"\ngpus = "{gpus}"\n\n'
            f'[train]\n{engine_toml}script = "train.py"\ncheckpoint_every = {checkpoint_every}\n'
            f"env = {{ {env_toml} }}\n{extra}\n"
        )

    def steps_advance(self, world: int, by: int = 5, timeout: float = 120) -> dict[str, Any]:
        first = self.wait_for(f"world size {world}", lambda s: s["world_size"] == world, timeout)
        return self.wait_for(f"step to advance past {first['step'] + by} at world {world}",
                             lambda s: s["world_size"] == world and s["step"] >= first["step"] + by,
                             timeout)  # fmt: skip

    def rescale_after(self, n0: int, reason: str, to: int | None = None,
                      timeout: float = 240) -> dict[str, Any]:  # fmt: skip
        """The first rescale event past the first n0 with this reason (and resulting size):
        picked by what it is and when, not by position or count, so a rescale from before
        the action (a late node's join during start-up; on torchft the start-up quorum
        grows replica by replica), or a join that could not complete and re-formed at the
        old size, cannot stand in for the one the action causes."""

        def found() -> dict[str, Any] | None:
            return next((e for e in self.events("rescale")[n0:] if e.get("reason") == reason
                         and to in (None, e.get("to_world_size"))), None)  # fmt: skip

        return wait_until(found, timeout, f"a {reason} rescale" + (f" to {to}" if to else ""),
                          0.5, lambda: f"{self.events('rescale')}\n{self.debug()}")

    def rescale_from(self, action: Callable[[], Any], reason: str, to: int | None = None,
                     timeout: float = 180) -> dict[str, Any]:  # fmt: skip
        """Run `action`, then the rescale it caused (`rescale_after` from before it)."""
        n0 = len(self.events("rescale"))
        action()
        return self.rescale_after(n0, reason, to, timeout)

    def replays_of(self, action: Callable[[], Any], reason: str, to: int | None = None,
                   timeout: float = 180) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run `action`; the rescale it caused (rescale_from) and what the workers' own
        sample traces say of it (scripts/chaos_lib/replays.py): `replayed`, the steps
        trained again since the action, counted once the groups started since have
        trained past every step trained before (`settled`, asserted). The head's
        `lost_steps` comes from throttled reports; this is the workers' own record."""
        from scripts.chaos_lib.replays import Window

        w = Window.open(self.trace_dir)
        r = self.rescale_from(action, reason, to, timeout)
        got = w.close(timeout)
        assert got["settled"], (got, r)
        return r, got

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
        from spotctl.agent import proctree

        return proctree.tagged_prefix(str(self.cluster_dir) + "/")

    def worker_report(self, node: str) -> dict[str, Any] | None:
        """A node's rank-0 worker's own report (status/worker-0.json); None before it wrote
        one."""
        try:
            return dict(json.loads((self.cluster_dir / "nodes" / node / "status" /
                                    "worker-0.json").read_text()))
        except (OSError, ValueError):
            return None

    def worker_pids(self, nodes: list[str]) -> dict[str, int]:
        """Each node's rank-0 worker process, from its own report (status/worker-0.json)."""
        reports = {n: self.worker_report(n) for n in nodes}
        assert all(reports.values()), f"no worker report from some of {nodes}"
        return {n: int(r["pid"]) for n, r in reports.items() if r}

    def head_status(self) -> dict[str, Any]:
        """The head's own /api/status, as the controller's client gets it."""
        from spotctl.control.reconcile import head_client

        with self._journal() as store:
            return dict(head_client(store, self.name).status())

    def debug(self) -> str:
        out = []
        for p in sorted(self.cluster_dir.glob("nodes/*/*.log")) + [self.cluster_dir / "head" / "head.log"]:
            if p.exists():
                lines = [x for x in p.read_text(errors="replace").splitlines() if "registry.py" not in x]
                out.append(f"--- {p.relative_to(self.cluster_dir)}\n" + "\n".join(lines[-15:]))
        return "\n".join(out)

    def teardown(self) -> None:
        from spotctl.agent import proctree

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


# --- the real CLI against a fake cloud: up -> status -> notice -> down ----------------------
# The provider-specific servers (moto, the fake Compute API) are tests/aws/conftest.py's and
# tests/gcp/conftest.py's (`aws_flow`, `gcp_flow` build a CloudFlow on them).


def procs_mentioning(root: Path) -> list[int]:
    """Processes whose command line mentions `root` (a test's directories)."""
    out = []
    needle = str(root).encode()
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if needle in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def describe_procs(pids: list[int]) -> list[str]:
    """`pid: command line` of each (what a leak report needs to name the process)."""
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "(gone)"
        out.append(f"{pid}: {cmd[:300]}")
    return out


def kill_procs_mentioning(root: Path) -> list[int]:
    """SIGKILL every process (and its process group) whose command line mentions `root`;
    returns their pids."""
    import signal

    pids = procs_mentioning(root)
    for pid in pids:
        for kill, target in ((os.killpg, pid), (os.kill, pid)):
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return pids


class MetadataRouter:
    """One loopback server standing in for every cloud node's metadata service: a request
    for `/<node>/<path>` goes to that node's own MetadataServer (the emulator: AWS IMDSv2
    and GCP, made on first use), so a test can send one node a notice
    (`router.node(id).preempt("aws")`). Cloud flows point the agents at it through
    SPOTCTL_METADATA_URL=`url_template`."""

    def __init__(self) -> None:
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        router = self
        self.servers: dict[str, Any] = {}
        self._lock = threading.Lock()

        class Route(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def forward(self) -> None:
                node, _, rest = self.path.lstrip("/").partition("/")
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                if not node:
                    self.send_error(404)
                    return
                up = http.client.HTTPConnection("127.0.0.1", router.node(node).port, timeout=600)
                hop = ("host", "connection", "content-length")
                try:  # as it came: IMDSv2 refuses what a proxy marks (X-Forwarded-For)
                    up.request(self.command, "/" + rest, body=body,
                               headers={k: v for k, v in self.headers.items()
                                        if k.lower() not in hop})  # fmt: skip
                    resp = up.getresponse()
                    data = resp.read()
                finally:
                    up.close()
                try:
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in (*hop, "transfer-encoding", "server", "date"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the agent gave up on a long poll

            do_GET = do_PUT = do_POST = forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Route)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         kwargs={"poll_interval": 0.05}).start()

    @property
    def url_template(self) -> str:
        return f"http://127.0.0.1:{self.port}/{{node}}"

    def node(self, node_id: str) -> Any:
        """That node's MetadataServer (started on first use)."""
        from spotctl.providers.local.metadata import MetadataServer

        with self._lock:
            if node_id not in self.servers:
                self.servers[node_id] = MetadataServer(instance_id=node_id).start()
            return self.servers[node_id]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        for srv in self.servers.values():
            srv.stop()


@pytest.fixture
def metadata_router() -> Iterator[MetadataRouter]:
    r = MetadataRouter()
    try:
        yield r
    finally:
        r.stop()


def cloud_spec_text(name: str, section: str, script: str = "train.py",
                    env: dict[str, str] | None = None, engine: str = "torchrun") -> str:  # fmt: skip
    """spotctl.toml for a cloud flow: templates/train.py, short steps, a cloud section,
    `[train] engine` written out (a torchft flow switches it: `use_torchft`)."""
    env = {"TRAIN_STEP_SLEEP_S": "0.05", "TRAIN_DATASET_SIZE": "4096", **(env or {})}
    env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    return (
        f'name = "{name}"\n\n'
        f'[train]\nengine = "{engine}"\nscript = "{script}"\ncheckpoint_every = 5\n'
        f'python = "{sys.executable}"\n'
        f"env = {{ {env_toml} }}\n\n" + section
    )


class CloudFlow(CliProject):
    """The real CLI on a cloud provider pointed at a fake (moto, the fake Compute API), with
    every instance's SSH sent to one loopback sshd: the seam of spotctl/remote/bootstrap.py
    (SPOTCTL_SSH_OVERRIDE[_KEY], SPOTCTL_HEAD_PORTS, SPOTCTL_SSH_REMOTE_ROOT, and
    SPOTCTL_METADATA_URL for the agents' notices). The bootstrap, the head (`spotctl head`)
    and the agents (torchrun + the train script) really run, from node directories under
    `remote`."""

    in_process = True

    def __init__(self, tmp: Path, name: str, spec: str, server: Sshd, key: Path,
                 metadata: MetadataRouter | None = None,
                 env_extra: dict[str, str] | None = None):  # fmt: skip
        self.remote = tmp / "remote"
        self.metadata = metadata
        self.downed = False  # a `down` ran clean: teardown need not run another
        seams = {
            "SPOTCTL_SSH_OVERRIDE": f"127.0.0.1:{server.port}",
            "SPOTCTL_SSH_OVERRIDE_KEY": str(key),
            "SPOTCTL_HEAD_PORTS": f"{free_port()}:{free_port()}",
            "SPOTCTL_SSH_REMOTE_ROOT": str(self.remote),
        }
        if metadata is not None:
            seams["SPOTCTL_METADATA_URL"] = metadata.url_template
        if 'script = "idle.py"' in spec:
            seams["SPOTCTL_UP_STEP_WAIT_S"] = "2"  # it never reports a step
        super().__init__(tmp, name, {**seams, **(env_extra or {})})
        (self.project / "spotctl.toml").write_text(spec)
        (self.project / "idle.py").write_text(IDLE_SCRIPT)

    def debug(self) -> str:
        logs = sorted(self.remote.glob("*/*/*.log")) + sorted(self.remote.glob("*/*/*/*.log"))
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-1500:]}" for p in logs)

    def leftover(self) -> list[int]:
        """Processes still running from the node directories or the state dir."""
        return procs_mentioning(self.remote) + procs_mentioning(self.home)

    def kill_leftovers(self) -> None:
        for root in (self.remote, self.home):
            kill_procs_mentioning(root)

    def up(self, provider: str, gpus: str, nodes: int, wait_s: int = 240) -> dict[str, Any]:
        """`up --json`: `nodes` launched, bootstrapped (one progress line each) and
        reporting."""
        p = self.cli("up", "--provider", provider, "--gpus", gpus, "--wait", str(wait_s),
                     "--json", timeout=wait_s + 360)  # fmt: skip
        up = dict(json.loads(p.stdout))
        assert len(up["launched"]) == nodes and up["nodes_reporting"] == nodes, up
        # `up --json` phases: JSON lines on stderr, per offer, then per node
        phases = [json.loads(x) for x in p.stderr.splitlines() if x.startswith('{"phase"')]
        assert any(x["phase"] == "launching" for x in phases), p.stderr
        done = [x for x in phases if x["phase"] == "bootstrapped"]
        assert sorted(x["node"] for x in done) == sorted(up["launched"]), p.stderr
        return up

    def down(self, *extra: str) -> dict[str, Any]:
        """`down --json`; then no process of the cluster is left."""
        out = dict(json.loads(self.cli("down", "--name", self.name, "--yes", "--json", *extra,
                                       timeout=300).stdout))  # fmt: skip
        self.downed = not out["leaks"]
        wait_until(lambda: not self.leftover(), 60, "the cluster's processes to end",
                   0.5, lambda: f"left running after down: {describe_procs(self.leftover())}")  # fmt: skip
        return out

    def run(self, provider: str, nodes: int, want_steps: int = 5) -> dict[str, Any]:
        """up, wait for the nodes (and a few training steps) in status, then down.
        Returns the last status seen before down."""
        up = self.up(provider, str(nodes), nodes)
        st = self.wait_for(f"world size {nodes} and step {want_steps}",
                           lambda s: s.get("world_size") == nodes
                           and (s.get("step") or 0) >= want_steps, timeout=240, interval=1)  # fmt: skip
        assert sorted(n["id"] for n in st["nodes"]) == sorted(up["launched"]), st
        assert all(n["state"] == "running" for n in st["nodes"]), st
        assert self.leftover(), "no head or agent runs from the node directories"
        self.down()
        return st

    # state_left() after a clean `down`: journaled as down, no key or lock left
    CLEAN = {"state": "down", "live_nodes": 0, "private_keys": [], "lock_held": False}

    def state_left(self) -> dict[str, Any]:
        """What the state dir still says about the cluster after `down`: its state and live
        node count (`list --json`), private keys and head credentials left in its cluster
        dir, and whether its reconcile lock is still held."""
        import fcntl

        [row] = [r for r in json.loads(self.cli("list", "--json").stdout)
                 if r["cluster"] == self.name]  # fmt: skip
        cdir = self.home / "clusters" / self.name
        keys = sorted(str(p.relative_to(cdir)) for p in cdir.rglob("*") if p.is_file()
                      and b"PRIVATE KEY" in p.read_bytes()[:200])  # fmt: skip
        held = False
        lock = cdir / "reconcile.lock"
        if lock.exists():
            with open(lock, "a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(f, fcntl.LOCK_UN)
                except OSError:
                    held = True
        return {"state": row["state"], "live_nodes": row["nodes"], "private_keys": keys,
                "lock_held": held}

    def up_notice_down(self, provider: str, gpus: str, nodes: int) -> dict[str, Any]:
        """up -> `nodes` reporting in status -> one gets a spot notice through its own metadata
        service (the cloud's protocol: `provider`'s) -> the head and status have it -> down.
        Returns down's JSON."""
        from spotctl.control.reconcile import heartbeat_fresh

        assert self.metadata is not None, "a notice needs the flow's MetadataRouter"
        up = self.up(provider, gpus, nodes)
        # every node in status and reporting: joining (its torchrun at the head's gate) or
        # running. Not all running: a start takes the nodes ready within the head's start
        # grace, the rest join through drains, and an idle script never drains (each join
        # waits out the drain timeout): over 100 s at 16 nodes, for no part of this flow
        st = self.wait_for(f"{nodes} nodes reporting", lambda s: len(s["nodes"]) == nodes
                           and {n["state"] for n in s["nodes"]} <= {"running", "joining"}
                           and all(heartbeat_fresh(n) for n in s["nodes"]),
                           timeout=240)  # fmt: skip
        assert sorted(n["id"] for n in st["nodes"]) == sorted(up["launched"]), st
        victim = sorted(up["launched"])[nodes // 2]
        self.metadata.node(victim).preempt(provider, in_s=120)
        [ev] = self.wait_event("notice", where=lambda e: e.get("node") == victim, timeout=60)
        assert ev["source"] == provider, ev
        self.wait_for("the notice in status",
                      lambda s: [n["id"] for n in s["nodes"] if n["notice"]] == [victim], 30)  # fmt: skip
        return self.down()

    def teardown(self) -> None:
        if (self.home / "state.db").exists() and not self.downed:
            self.cli("down", "--name", self.name, "--yes", check=False, timeout=300)
        self.kill_leftovers()


# A train script that starts at once and holds its place (a drain's SIGUSR1 is ignored:
# nothing to checkpoint): for flows about launching, bootstrapping, notices and cleanup
# rather than training.
IDLE_SCRIPT = """import signal, time
signal.signal(signal.SIGUSR1, lambda *_: None)
time.sleep(3600)
"""


@pytest.fixture
def cloud_flow(
    tmp_path: Path, sshd: Sshd, client_key: Path, metadata_router: MetadataRouter
) -> Iterator[Callable[..., CloudFlow]]:
    """cloud_flow(name, spec_text, env_extra) -> a CloudFlow on the `sshd` fixture (torn
    down after the test: `down`, then any process left is killed)."""
    made: list[CloudFlow] = []

    def make(name: str, spec: str, env_extra: dict[str, str] | None = None) -> CloudFlow:
        f = CloudFlow(tmp_path / name, name, spec, sshd, client_key, metadata_router, env_extra)
        made.append(f)
        return f

    yield make
    for f in made:
        f.teardown()


def use_torchft(project: CliProject) -> None:
    """Switch a project's spotctl.toml to `[train] engine = "torchft"` (before `up`)."""
    spec = project.project / "spotctl.toml"
    text = spec.read_text()
    text = re.sub(r'^engine = "torchrun"\n', "", text, count=1, flags=re.M)
    assert "\n[train]\n" in text and "engine" not in text, text
    spec.write_text(text.replace("\n[train]\n", '\n[train]\nengine = "torchft"\n', 1))


def lighthouse_status(address: str) -> str:
    """The text of torchft's Lighthouse's /status page at `address` (its quorum: ids of
    the replicas in it); raises when nothing answers there."""
    with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=10) as r:
        return str(r.read().decode(errors="replace"))


def run_torchft_flow(flow: CloudFlow, provider: str, nodes: int = 2,
                     want_steps: int = 5,
                     look: Callable[[], Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """A CloudFlow on the torchft engine: up (the head gets its Lighthouse on a free third
    SPOTCTL_HEAD_PORTS port), `nodes` replicas training in one quorum, then down. Returns
    what it saw before down: `status`, the head's `head_json` (its head.json on the head
    "VM"), the `head` the state dir recorded, each node's `agents` (agent.json), and the
    Lighthouse's `lighthouse_status` page, and what `look()` returned (`looked`), called
    while the nodes train."""
    use_torchft(flow)
    api, _, store = flow.env["SPOTCTL_HEAD_PORTS"].partition(":")
    flow.env["SPOTCTL_HEAD_PORTS"] = f"{api}:{store}:{free_port()}"
    up = flow.up(provider, str(nodes), nodes)
    st = flow.wait_for(f"{nodes} replicas at step {want_steps}",
                       lambda s: s.get("world_size") == nodes
                       and (s.get("step") or 0) >= want_steps, timeout=240, interval=1)  # fmt: skip
    assert sorted(n["id"] for n in st["nodes"]) == sorted(up["launched"]), st
    cdir = flow.remote / flow.name
    head_json = json.loads((cdir / "head" / "head" / "head.json").read_text())
    token = (flow.home / "clusters" / flow.name / "token").read_text().strip()
    req = urllib.request.Request(head_json["url"] + "/api/status",
                                 headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.load(r)["engine"] == "torchft"  # the head knows its cluster's engine
    agents = {n: json.loads((cdir / n / "agent.json").read_text()) for n in up["launched"]}
    page = lighthouse_status(head_json["lighthouse"])
    looked = look() if look is not None else None
    from spotctl.state import Store

    store = Store(flow.home)
    try:
        recorded = dict(store.get_cluster(flow.name).head)
    finally:
        store.close()
    flow.down()
    return {"status": st, "head_json": head_json, "agents": agents, "lighthouse_status": page,
            "head": recorded, "looked": looked}  # fmt: skip


def remote_worker_reports(remote: Path, name: str) -> dict[str, dict[str, Any]]:
    """Each node's rank-0 worker's own status report (`work/status/worker-0.json`), for
    nodes whose directories are under `remote` (SPOTCTL_SSH_REMOTE_ROOT: ssh hosts and the
    cloud stand-ins' instances), by node id."""
    found = sorted(remote.glob(f"{name}/*/work/status/worker-0.json"))
    return {p.parent.parent.parent.name: json.loads(p.read_text()) for p in found}


def trace_records(trace: Path) -> list[tuple[str, int, int]]:
    """(incarnation, dp_rank, step) of every step every worker recorded in the template's
    sample trace (SPOTCTL_TRACE_SAMPLES)."""
    out = []
    for f in sorted(trace.glob("*.txt")):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3:
                out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


def run_head_replacement_flow(flow: CloudFlow, provider: str, trace: Path,
                              end_vm: Callable[[str], None]) -> dict[str, Any]:
    """A cloud cluster of 2 whose head replaces a preempted worker by itself: `up`, then
    nothing from the controller. One worker gets its cloud's notice, leaves, and `end_vm`
    ends its VM as the cloud would; the head's loop launches and bootstraps a replacement.
    Checked from the workers' own records: both ranks of the new world step on past the
    leave, and no step was skipped; from the controller's journal: it launched nothing
    after `up`. The flow's spec must trace samples into `trace`. Returns the ids (first,
    victim, new)."""
    spec = flow.project / "spotctl.toml"
    spec.write_text(spec.read_text() + "\n[rebalance]\non_head_interval_s = 5\n")
    up = flow.up(provider, "2", 2)
    first = sorted(up["launched"])
    flow.wait_for("2 workers training", lambda s: s.get("world_size") == 2
                  and (s.get("step") or 0) >= 5, timeout=240, interval=1)  # fmt: skip
    journal_after_up = len(flow.events())
    victim = first[0]
    assert flow.metadata is not None
    t_notice = time.monotonic()
    flow.metadata.node(victim).preempt(provider, **({"in_s": 120} if provider == "aws" else {}))
    flow.wait_for("the notice's leave", lambda s: victim not in
                  [n["id"] for n in s["nodes"] if n["state"] in ("running", "joining")],
                  timeout=120)  # fmt: skip
    step_at_leave = max(s for _, _, s in trace_records(trace))
    end_vm(victim)
    kill_procs_mentioning(flow.remote / flow.name / victim)

    def replaced(s: dict[str, Any]) -> bool:
        ids = {n["id"] for n in s["nodes"] if n["state"] == "running"}
        return len(ids) == 2 and victim not in ids and s.get("world_size") == 2

    st = flow.wait_for("a replacement the head launched, training", replaced, timeout=300,
                       interval=2)
    [new] = sorted({n["id"] for n in st["nodes"] if n["state"] == "running"} - set(first))
    # (seen through `status`, polled every 2 s)
    print(f"{provider}: notice -> the head's replacement training: "
          f"{time.monotonic() - t_notice:.1f} s")
    wait_until(lambda: max(s for _, _, s in trace_records(trace)) >= step_at_leave + 10, 120,
               "steps after the replacement joined", 1)  # fmt: skip
    recs = trace_records(trace)
    last = max(recs, key=lambda r: r[2])[0]  # the incarnation of the latest step
    assert {r for i, r, s in recs if i == last and s > step_at_leave} == {0, 1}, recs[-10:]
    steps = {s for _, _, s in recs}
    assert steps == set(range(1, max(steps) + 1)), "a step was never trained"
    log = next(flow.remote.glob(f"{flow.name}/head/head/rebalance.log")).read_text()
    assert new in log, log[-3000:]
    later = flow.events()[journal_after_up:]
    assert not [e for e in later if e["type"] in ("launch", "plan-launch", "plan-replace")], later
    return {"first": first, "victim": victim, "new": new}


def run_spanning_group_flow(flow: CloudFlow, provider: str) -> dict[str, Any]:
    """run_torchft_flow with `[train] nodes_per_replica = 2` and two nodes: one replica
    group spanning both (issue 29), judged by the workers' own reports, read while they
    train: ranks 0 and 1 of a world of 2 in one replica, one Manager address; the head
    puts both in group g0 and the agents were told the group's size. Returns what
    run_torchft_flow returns."""
    spec = flow.project / "spotctl.toml"
    spec.write_text(spec.read_text().replace("\n[train]\n", "\n[train]\nnodes_per_replica = 2\n", 1))
    out = run_torchft_flow(flow, provider, nodes=2,
                           look=lambda: remote_worker_reports(flow.remote, flow.name))  # fmt: skip
    rep = out["looked"]
    assert sorted(rep) == sorted(out["agents"]), rep
    assert sorted(r["rank"] for r in rep.values()) == [0, 1], rep
    assert all(r["replicas"] == 1 and r["world_size"] == 2 for r in rep.values()), rep
    assert len({r["manager"] for r in rep.values()}) == 1, rep
    assert {n["group"] for n in out["status"]["nodes"]} == {"g0"}, out["status"]["nodes"]
    assert all(cfg["replica_nodes"] == 2 for cfg in out["agents"].values()), out["agents"]
    return out


# --- real sshd on loopback ------------------------------------------------------------------


def sshd_missing() -> str | None:
    """Why sshd is unusable here, or None. Nothing is installed mid-session: scripts/test
    runs scripts/install-sshd before pytest starts."""
    if not os.path.exists(SSHD):
        return "OpenSSH sshd is not installed (scripts/test installs it: scripts/install-sshd)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen is not installed (scripts/install-sshd)"
    return None


def keygen(path: Path) -> Path:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "spotctl-test", "-f", str(path)],
        check=True,
    )
    return path


@dataclass
class Sshd:
    """A running sshd on 127.0.0.1:port."""

    port: int
    host_key: Path  # private host key; the public one is host_key.with_suffix(".pub")
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def host_pub(self) -> str:
        return Path(str(self.host_key) + ".pub").read_text().split()[1]


class PortTaken(RuntimeError):
    """sshd (or the head) could not bind its port: someone took it after it was picked."""


class SshdFactory:
    """Each sshd runs as a non-daemon child (`sshd -D -e -f <config>`) on a free 127.0.0.1
    port, with its own ed25519 host key and one authorized test key."""

    def __init__(self, base: Path, client_key: Path):
        self.base = base
        self.client_key = client_key
        self.started: list[Sshd] = []
        self.n = 0

    def start(self, port: int | None = None, host_key: Path | None = None,
              config: str = "") -> Sshd:
        """`config`: more sshd_config lines (e.g. "GatewayPorts yes\n")."""
        # A port picked here was free a moment ago; another test (or xdist worker) may
        # take it before sshd binds it: then pick another. A port given is used as is.
        for attempt in range(5):
            try:
                return self._start(port or free_port(), host_key, config)
            except PortTaken:
                if port is not None or attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def _start(self, port: int, host_key: Path | None, config: str = "") -> Sshd:
        self.n += 1
        d = self.base / f"sshd{self.n}"
        d.mkdir(mode=0o700)
        host_key = host_key or keygen(d / "host_ed25519")
        auth = d / "authorized_keys"
        auth.write_text(Path(str(self.client_key) + ".pub").read_text())
        sftp = next(
            (
                p
                for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server")
                if os.path.exists(p)
            ),
            "internal-sftp",
        )
        cfg = d / "sshd_config"
        cfg.write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\n"
            f"PidFile {d / 'sshd.pid'}\nAuthorizedKeysFile {auth}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PubkeyAuthentication yes\nPermitRootLogin yes\nStrictModes no\nUsePAM no\n"
            f"Subsystem sftp {sftp}\nLogLevel VERBOSE\nMaxStartups 50\n{config}"
        )
        # sshd insists on its privilege separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        log = d / "sshd.log"
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(cfg)],
            stdout=open(log, "ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

        def banner() -> bool:
            if proc.poll() is not None:
                text = log.read_text()[-2000:]
                if "Address already in use" in text:
                    raise PortTaken(text)
                raise RuntimeError(f"sshd exited: {text}")
            if f"Server listening on 127.0.0.1 port {port}" not in log.read_text():
                return False  # the banner below could be another sshd's on a taken port
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    return s.recv(4).startswith(b"SSH-")
            except OSError:
                return False

        wait_until(banner, 20, "sshd to listen", 0.1, lambda: log.read_text()[-2000:])
        sshd = Sshd(port, host_key, proc, log)
        self.started.append(sshd)
        return sshd

    def stop_all(self) -> None:
        for s in self.started:
            s.stop()


@pytest.fixture(scope="session")
def client_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    why = sshd_missing()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("client")
    return keygen(d / "id_ed25519")


@pytest.fixture
def sshd_factory(tmp_path: Path, client_key: Path) -> Iterator[SshdFactory]:
    f = SshdFactory(tmp_path, client_key)
    try:
        yield f
    finally:
        f.stop_all()


@pytest.fixture
def sshd(sshd_factory: SshdFactory) -> Sshd:
    return sshd_factory.start()


class Head:
    """The real head (`spotctl head`) as a child process on loopback."""

    def __init__(self, base: Path):
        import secrets

        self.dir = base / "head"
        self.dir.mkdir(mode=0o700)
        self.token = secrets.token_urlsafe(32)
        self.token_file = base / "head-token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, self.token.encode())
        os.close(fd)
        # What the agents' torchrun runs in bootstrap tests: nothing, for a long time.
        self.script = base / "idle_train.py"
        self.script.write_text("import time\ntime.sleep(3600)\n")
        self.log = self.dir / "head.log"
        # the two ports were free a moment ago; another test (or xdist worker) may take one
        # before the head binds it: then the head exits naming it, and we pick again
        for attempt in range(5):
            try:
                self._start(free_port(), free_port())
                return
            except PortTaken:
                if attempt == 4:
                    raise

    def _start(self, http_port: int, store_port: int) -> None:
        self.url = f"http://127.0.0.1:{http_port}"
        self.store_port = store_port
        start = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen(
            [*SPOTCTL, "head", "--dir", str(self.dir), "--token-file", str(self.token_file),
             "--host", "127.0.0.1", "--http-port", str(http_port), "--store-port", str(store_port)],
            stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

        def up() -> bool:
            if self.proc.poll() is not None:
                text = self.log.read_text(errors="replace")[start:]
                if "address already in use" in text.lower():
                    raise PortTaken(text[-2000:])
                raise RuntimeError(f"head exited: {text[-2000:]}")
            return self.healthy()

        wait_until(up, 60, "the head to answer /api/health", 0.2,
                   lambda: self.log.read_text()[-2000:])  # fmt: skip

    def _get(self, path: str) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            return dict(json.load(r))

    def healthy(self) -> bool:
        try:
            return bool(self._get("/api/health").get("ok"))
        except OSError:
            return False

    def status(self) -> dict[str, Any]:
        return self._get("/api/status")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def head(tmp_path: Path) -> Iterator[Head]:
    h = Head(tmp_path)
    try:
        yield h
    finally:
        h.close()


# --- the metadata emulator ------------------------------------------------------------------


@pytest.fixture
def metadata_server() -> Iterator[Callable[..., Any]]:
    """metadata_server(**kw) starts a MetadataServer(**kw) on loopback, stopped after the
    test."""
    from spotctl.providers.local.metadata import MetadataServer

    started: list[Any] = []

    def start(**kw: Any) -> Any:
        srv = MetadataServer(**kw).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def refusing_address() -> Iterator[str]:
    """host:port on loopback where every connection is refused: a socket bound (and held,
    so no one else gets the port) but never listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def node_steps(logs: Path, node: str) -> list[dict[str, Any]]:
    """A node's own step log (`<logs>/<node>.jsonl`, one JSON object a line, as
    tests/elastic/ft_train.py writes it through FT_STEP_LOG); a line still being written is
    skipped."""
    p = logs / f"{node}.jsonl"
    out = []
    for line in (p.read_text().splitlines() if p.exists() else []):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def up_ft_train(c: Any, nodes: int, together: bool = True, spec_extra: str = "",
                **env: str) -> Path:
    """`up` a local cluster of `nodes` on the torchft engine training
    tests/elastic/ft_train.py (FT_STEP_DELAY 0.05 s, a checkpoint every 25 steps, `env`
    added to the workers', `spec_extra` to the spec as write_spec's `extra`), each node
    logging its steps to `<tmp>/steps/<node>.jsonl`; with `together`, wait until every
    node has trained in one quorum of all. Returns the logs' directory."""
    shutil.copy(REPO / "tests" / "elastic" / "ft_train.py", c.project / "train.py")
    logs = c.tmp / "steps"
    logs.mkdir()
    c.write_spec(str(nodes), checkpoint_every=25, engine="torchft", extra=spec_extra,
                 train_env={"FT_STEP_LOG": f"{logs}/{{node}}.jsonl", "FT_STEP_DELAY": "0.05",
                            **env})
    c.cli("up", "--wait", "120")
    if together:
        names = [f"n{i}" for i in range(1, nodes + 1)]
        wait_until(lambda: all(any(s["replicas"] == nodes for s in node_steps(logs, n))
                               for n in names), 240, f"{nodes} replicas in one quorum", 0.5,
                   c.debug)
    return logs


def last_step(logs: Path, node: str) -> int:
    """The last step a node logged (0 before its first)."""
    s = node_steps(logs, node)
    return int(s[-1]["step"]) if s else 0


def send_and_read(host: str, port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Raw bytes on a fresh connection; everything the server answers until it closes (a
    send the server cut short, or a read that errors, ends it: the answer says why)."""
    with socket.create_connection((host, port), timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # closed while still sending: what it answered tells why
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        return out
