"""Make hosts spotctl nodes over SSH (fabric), many at a time.

For each host, in a bounded thread pool: wait for SSH (backoff while the VM boots), upload
the rendered files (bootstrap script, systemd unit, agent config, token), run the script
(installs what is missing, starts the agent under systemd or a setsid fallback), and
optionally confirm the agent's first heartbeat at the head.

Idempotent: uploads are compared by SHA-256 and skipped when equal; an agent already
running with the same files is left alone, and the host reports changed=False.
Secrets: the token travels only over SFTP into a 0600 file; it is never on a command
line, in the script's output, or in a log line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import shlex
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from spotctl.agent.config import AgentConfig
from spotctl.agent.runas import WRITABLE_CHECK
from spotctl.errors import BootstrapError
from spotctl.head.auth import node_token
from spotctl.head.client import urlopen_direct
from spotctl.head.rebalancer import BUNDLE
from spotctl.providers.base import HeadInfo, Instance, ProviderContext
from spotctl.remote.package import MIN_TORCH, TORCH_DRIVER, TORCH_SPEC, NodePackage, Project
from spotctl.remote.ssh import HostTarget, RemoteResult, connect, run

if TYPE_CHECKING:
    from fabric import Connection

    from spotctl.remote.interp import NodePython
    from spotctl.state import NodeRow, Store

__all__ = [
    "AGENT_CONFIG",
    "BootstrapFiles",
    "HeadProbe",
    "HeartbeatProbe",
    "HostResult",
    "HostTarget",
    "TOKEN_FILE",
    "CloudNodes",
    "SshOverride",
    "bootstrap_agents",
    "bootstrap_hosts",
    "release_hosts",
    "render_bootstrap",
    "tail_node_log",
]

log = logging.getLogger("spotctl.remote.bootstrap")

SCRIPT = "bootstrap.sh"
UNIT_FILE = "spotctl-agent.service"
AGENT_CONFIG = "agent.json"
TOKEN_FILE = "token"
# The uploaded package (spotctl's wheel, its pinned dependencies) and project, relative to
# the node directory; see spotctl.remote.package.
PKG_DIR = "pkg"
PROJECT_DIR = "project"


@dataclass
class RemoteFile:
    """One file uploaded into the node's directory."""

    name: str  # relative to the node directory
    content: bytes
    mode: int = 0o600
    # Whether a change to this file needs the running agent restarted.
    restarts_agent: bool = True

    @property
    def sha256(self) -> str:
        return _digest(self.content)


# Digests of big shared contents (wheels, project files), computed once per process rather
# than once per host; the entry holds the bytes, so an id is never reused while cached.
_DIGESTS: dict[int, tuple[bytes, str]] = {}


def _digest(content: bytes) -> str:
    if len(content) < 65536:
        return hashlib.sha256(content).hexdigest()
    hit = _DIGESTS.get(id(content))
    if hit is None or hit[0] is not content:
        hit = (content, hashlib.sha256(content).hexdigest())
        _DIGESTS[id(content)] = hit
    return hit[1]


@dataclass
class BootstrapFiles:
    """Everything rendered for one host. Build it with `render_bootstrap`."""

    remote_dir: str  # absolute node directory on the host
    files: list[RemoteFile]

    def get(self, name: str) -> RemoteFile:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)


@dataclass
class HostResult:
    """Per-host outcome; one failing host never hides the others."""

    node_id: str
    ok: bool
    reason: str  # "" when ok; otherwise one line naming what failed
    changed: bool  # anything uploaded, installed, started or restarted
    seconds: float
    agent: str = ""  # e.g. "started mode=fallback pid=123", "running"
    uploaded: list[str] = field(default_factory=list)  # names of files that changed
    sent_bytes: int = 0  # what those uploads weighed (unchanged files are skipped)
    # what the user should know about how the node was set up, e.g. a Python older than
    # some pins allow ("" = nothing)
    note: str = ""


# Called once per finished host with (result, hosts done, hosts in all): the caller decides
# how to show it (a rich bar in the CLI, nothing in tests); this layer never prints.
HostProgress = Callable[[HostResult, int, int], None]


class HeartbeatProbe(Protocol):
    """Where the bootstrap looks for the agent's heartbeats (the head, in production)."""

    def last_heartbeat(self, node_id: str) -> float | None:
        """The node's latest heartbeat time as the head recorded it, None if never."""


class HeadProbe:
    """Reads heartbeats from the head's coordinator API (`GET /api/status`)."""

    def __init__(self, url: str, token: str, timeout_s: float = 5.0):
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def last_heartbeat(self, node_id: str) -> float | None:
        return self.last_heartbeats().get(node_id)

    def last_heartbeats(self) -> dict[str, float]:
        """Every node's latest heartbeat in one request ({} when the head does not answer)."""
        req = urllib.request.Request(
            self.url + "/api/status", headers={"Authorization": f"Bearer {self._token}"}
        )
        try:
            with urlopen_direct(req, timeout=self.timeout_s) as r:
                status = json.load(r)
        except (urllib.error.URLError, OSError, ValueError):
            return {}
        out: dict[str, float] = {}
        for node_id, node in (status.get("nodes") or {}).items():
            hb = (node or {}).get("last_heartbeat")
            if hb:
                out[str(node_id)] = float(hb)
        return out


def _templates_dir() -> Path:
    """templates/ inside the installed package, else the source checkout's."""
    pkg = Path(__file__).resolve().parent.parent
    here = pkg
    for cand in (pkg / "templates", pkg.parent / "templates"):
        if (cand / SCRIPT).is_file():
            return cand
    raise BootstrapError(f"bootstrap templates not found (looked in {here}/templates)")


def _fill(template: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        template = template.replace(f"@@{k}@@", v)
    if "@@" in template:
        left = template[template.index("@@") :].split("\n", 1)[0]
        raise BootstrapError(f"bootstrap template has an unfilled placeholder: {left}")
    return template


def unit_name(cluster: str, node_id: str) -> str:
    """One unit per node, so several nodes (or clusters) can share a machine."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in f"{cluster}-{node_id}")
    return f"spotctl-agent-{safe}"


def node_venv(node_dir: str, package: NodePackage, base_python: str) -> str:
    """The venv a node runs in: `<remote root>/venvs/<hash of the pinned dependencies and
    base interpreter, and MIN_TORCH: whether the image's torch is seen>`, shared by the
    nodes of a host (a new spotctl wheel alone is reinstalled in place; new dependencies get
    a new venv)."""
    deps = hashlib.sha256(
        (package.requirements + package.torch_spec + base_python + repr(MIN_TORCH)).encode()
    ).hexdigest()[:16]
    return f"{str(PurePosixPath(node_dir).parent.parent).rstrip('/')}/venvs/{deps}"


def start_together(cfg: AgentConfig, n: int) -> AgentConfig:
    """Nodes bootstrapped together start together: on torchft their replicas' first quorum
    waits (bounded) for `n` of them, instead of one training and the others healing in
    (spotctl.elastic.ft; a cluster that already has a quorum is not waited for)."""
    if cfg.engine != "torchft" or n < 2:
        return cfg
    env = dict(cfg.env)
    env.setdefault("SPOTCTL_FT_START_REPLICAS", str(n))
    return dataclasses.replace(cfg, env=env)


def render_bootstrap(
    target: HostTarget,
    config: AgentConfig,
    token: str,
    *,
    python: str = "python3",
    venv: str = "",
    package: NodePackage | None = None,
    project: Project | None = None,
    agent_argv: Sequence[str] | None = None,
    extra: dict[str, bytes] | None = None,
    project_restarts: bool = True,
) -> BootstrapFiles:
    """Render the templates for one host.

    The node directory is `target.remote_dir` (absolute). The config's token_file is set
    to `<dir>/token` and a relative workdir is placed under the node directory.
    `agent_argv` defaults to `<python> -m spotctl.cli.app agent --config <dir>/agent.json`.
    `extra` files (e.g. the training script) are uploaded next to them.

    With a `package`, `python` is the image's interpreter the node's venv is made from
    (default `<remote root>/venvs/<hash of the pinned dependencies>`, shared by the nodes
    of a host), and the agent and torchrun run in that venv. With a `project`, its files
    go to `<dir>/project/` and a training script inside it is run from there; a change
    to them restarts the agent unless `project_restarts` is False (the head, which only
    hands them on).
    """
    d = target.remote_dir.rstrip("/")
    if not d.startswith("/"):
        raise BootstrapError(f"{target.label}: remote_dir must be absolute, got {d!r}")
    if not token or "\n" in token.strip():
        raise BootstrapError("cluster token is empty or not one line")
    if package is not None and target.python:
        python = target.python  # what the node's probe chose (spotctl.remote.interp)
    if package is not None and not venv:
        venv = node_venv(d, package, python)
    py = f"{venv.rstrip('/')}/bin/python" if venv else python
    workdir = config.workdir or "work"
    if not workdir.startswith("/"):
        workdir = f"{d}/{workdir}"
    config = dataclasses.replace(config, token_file=f"{d}/{TOKEN_FILE}", workdir=workdir)
    if package is not None:
        config.python = py  # torchrun's workers need the venv's spotctl too
    if project is not None and config.script:
        local = Path(config.script)
        if not local.is_absolute():
            local = Path.cwd() / local
        try:
            in_project = local.resolve().relative_to(project.root).as_posix()
        except ValueError:
            in_project = ""
        if in_project in project.files:
            config.script = f"{d}/{PROJECT_DIR}/{in_project}"
    argv = list(agent_argv or [py, "-m", "spotctl.cli.app", "agent", "--config"])
    if agent_argv is None:
        argv.append(f"{d}/{AGENT_CONFIG}")
    tdir = _templates_dir()
    unit = unit_name(config.cluster, target.node_id)
    values = {
        "DIR": shlex.quote(d),
        "PYTHON": shlex.quote(py),
        "VENV": shlex.quote(venv),
        "BASE_PYTHON": shlex.quote(python),
        "TORCH_SPEC": shlex.quote(package.torch_spec if package else TORCH_SPEC),
        "MIN_TORCH": ".".join(map(str, MIN_TORCH)),
        "TORCH_DRIVER": str(TORCH_DRIVER),
        "OLDER_PINS": "1" if target.older_pins else "",
        "UNIT": shlex.quote(unit),
        "AGENT_ARGV": shlex.join(argv),
        # the training workers' user; the script decides whether this host allows it
        "TRAIN_USER": shlex.quote(config.run_as),
        "WRITABLE_CHECK": shlex.quote(WRITABLE_CHECK),
    }
    script = _fill((tdir / SCRIPT).read_text(), values)
    unit_text = _fill(
        (tdir / UNIT_FILE).read_text(),
        {
            "CLUSTER": config.cluster,
            "NODE": target.node_id,
            "USER": target.user,
            "DIR": d,
            "AGENT_ARGV": shlex.join(argv),
        },
    )
    files = [
        RemoteFile(SCRIPT, script.encode(), 0o700, restarts_agent=False),
        RemoteFile(UNIT_FILE, unit_text.encode(), 0o644),
        # 0600: train.env may carry credentials the user put there.
        RemoteFile(AGENT_CONFIG, (json.dumps(config.to_json(), indent=2) + "\n").encode()),
        RemoteFile(TOKEN_FILE, (token.strip() + "\n").encode()),
    ]
    for name, content in (extra or {}).items():
        files.append(RemoteFile(name, content, 0o644))
    if package is not None:
        for name, content in package.files(PKG_DIR).items():
            # a new package is a new key: that (and not each wheel) restarts the agent
            files.append(RemoteFile(name, content, 0o644, restarts_agent=name.endswith("/key")))
    if project is not None:
        for rel, content in project.files.items():
            files.append(RemoteFile(f"{PROJECT_DIR}/{rel}", content, 0o644,
                                    restarts_agent=project_restarts))
    return BootstrapFiles(remote_dir=d, files=files)


# Asks a node (over its open connection) which interpreter its venv is made from.
PythonChooser = Callable[["Connection", HostTarget], "NodePython"]


def python_chooser(package: NodePackage | None, torch_envs: Sequence[str],
                   base: str) -> PythonChooser | None:
    """The probe step for a bootstrap that ships `package`: the image's torch environments,
    then `base`, then (with torch environments to look for) the login shell's python3
    (spotctl.remote.interp). None without a package (nothing is installed)."""
    if package is None:
        return None
    from spotctl.remote import interp

    return interp.python_chooser(package, interp.candidates_for(torch_envs, base),
                                 login=bool(torch_envs))


@dataclass
class _Opts:
    wait_s: float
    attempt_timeout_s: float
    command_timeout_s: float
    heartbeat_timeout_s: float
    probe: HeartbeatProbe | None
    # asks the node which interpreter to build its venv from (None: the caller's)
    choose_python: PythonChooser | None = None


def bootstrap_hosts(
    hosts: list[HostTarget],
    render: Callable[[HostTarget], BootstrapFiles],
    known_hosts: Path,
    parallel: int = 8,
    progress: HostProgress | None = None,
    *,
    wait_s: float = 300.0,
    attempt_timeout_s: float = 10.0,
    command_timeout_s: float = 1800.0,
    probe: HeartbeatProbe | None = None,
    heartbeat_timeout_s: float = 120.0,
    choose_python: PythonChooser | None = None,
) -> list[HostResult]:
    """Bootstrap every host; results in the order of `hosts`.

    `wait_s` bounds the wait for SSH per host (a booting VM); `command_timeout_s` bounds
    the install; with a `probe`, a host is ok only once its agent heartbeats at the head
    within `heartbeat_timeout_s`. With `choose_python`, each node is asked first which of
    its interpreters to build the venv from (render then sees it as `target.python`).
    """
    opts = _Opts(wait_s, attempt_timeout_s, command_timeout_s, heartbeat_timeout_s, probe,
                 choose_python)
    results: dict[int, HostResult] = {}
    if not hosts:
        return []
    done = 0

    def finish(i: int, res: HostResult) -> None:
        nonlocal done
        results[i] = res
        done += 1
        if progress is not None:
            progress(res, done, len(hosts))

    # Only SSH work holds a pool slot; a host whose agent started waits for its first
    # heartbeat in `waiting`, polled for all such hosts at once by this thread.
    waiting: dict[int, _Waiting] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(hosts)))) as pool:
        futs = {
            pool.submit(_bootstrap_one, h, render, known_hosts, opts): i
            for i, h in enumerate(hosts)
        }
        pending = set(futs)
        while pending or waiting:
            if pending:
                finished, pending = wait_futures(
                    pending, timeout=0.5 if waiting else None, return_when=FIRST_COMPLETED
                )
                for fut in finished:
                    i = futs[fut]
                    res, w = fut.result()
                    if w is None:
                        finish(i, res)
                    else:
                        waiting[i] = w
            elif waiting:
                time.sleep(0.5)
            if waiting and probe is not None:
                beats = _heartbeats(probe, [w.target.node_id for w in waiting.values()])
                now = time.monotonic()
                for i, w in list(waiting.items()):
                    hb = beats.get(w.target.node_id)
                    if hb is not None and (w.baseline is None or hb > w.baseline):
                        w.result.seconds = now - w.t0
                        finish(i, w.result)
                    elif now >= w.deadline:
                        reason = (
                            f"{w.target.label}: agent started but no heartbeat reached the head "
                            f"within {heartbeat_timeout_s:.0f}s (see agent.log in "
                            f"{w.target.remote_dir})"
                        )
                        log.info("bootstrap failed: %s", reason)
                        finish(i, dataclasses.replace(w.result, ok=False, reason=reason,
                                                      seconds=now - w.t0))  # fmt: skip
                    else:
                        continue
                    del waiting[i]
    return [results[i] for i in range(len(hosts))]


@dataclass
class _Waiting:
    """A host whose SSH work is done, waiting for its agent's first heartbeat."""

    result: HostResult
    target: HostTarget
    baseline: float | None
    t0: float
    deadline: float


def _heartbeats(probe: HeartbeatProbe, node_ids: list[str]) -> dict[str, float]:
    many = getattr(probe, "last_heartbeats", None)
    if callable(many):
        return dict(many())
    out: dict[str, float] = {}
    for n in node_ids:
        hb = probe.last_heartbeat(n)
        if hb is not None:
            out[n] = hb
    return out


def _bootstrap_one(
    target: HostTarget,
    render: Callable[[HostTarget], BootstrapFiles],
    known_hosts: Path,
    opts: _Opts,
) -> tuple[HostResult, _Waiting | None]:
    t0 = time.monotonic()
    try:
        res, resolved, baseline = _bootstrap(target, render, known_hosts, opts)
        res.seconds = time.monotonic() - t0
        if opts.probe is None:
            return res, None
        deadline = time.monotonic() + opts.heartbeat_timeout_s
        return res, _Waiting(res, resolved, baseline, t0, deadline)
    except Exception as e:  # one host's failure is data, never an exception for the others
        reason = str(e) if isinstance(e, BootstrapError) else f"{type(e).__name__}: {e}"
        if not reason.startswith(target.node_id):
            reason = f"{target.label}: {reason}"
        log.info("bootstrap failed: %s", reason)  # returned as data; the caller reports it
        return HostResult(target.node_id, False, reason, False, time.monotonic() - t0), None


def _check(target: HostTarget, what: str, r: RemoteResult) -> RemoteResult:
    if not r.ok:
        lines = (r.stdout + "\n" + r.stderr).strip().splitlines()
        tail = lines[-1] if lines else f"exit {r.exit_code}"
        raise BootstrapError(f"{target.label}: {what} failed: {tail}")
    return r


def _resolve_dir(conn: Connection, target: HostTarget) -> HostTarget:
    d = target.remote_dir or f".spotctl/{target.node_id}"
    if d.startswith("/"):
        return target
    home = _check(target, "reading $HOME", run(conn, 'printf %s "$HOME"')).stdout.strip()
    if not home.startswith("/"):
        raise BootstrapError(f"{target.label}: remote $HOME is not an absolute path")
    return dataclasses.replace(target, remote_dir=f"{home.rstrip('/')}/{d}")


def _remote_sums(conn: Connection, target: HostTarget, files: BootstrapFiles) -> dict[str, str]:
    d = shlex.quote(files.remote_dir)
    names = " ".join(shlex.quote(f.name) for f in files.files)
    # Modes are re-asserted on every run, so a token someone made readable is fixed even
    # when its content is unchanged.
    modes = "".join(
        f"if [ -e {shlex.quote(f.name)} ]; then chmod {f.mode:o} {shlex.quote(f.name)}; fi; "
        for f in files.files
    )
    cmd = (
        f"umask 077; mkdir -p {d} && chmod 700 {d} && cd {d} && {modes}"
        f"{{ sha256sum -- {names} 2>/dev/null || true; }}"
    )
    out = _check(target, "preparing the node directory", run(conn, cmd, 60)).stdout
    sums: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2:
            sums[parts[1].lstrip("*")] = parts[0]
    return sums


def _upload(conn: Connection, files: BootstrapFiles, f: RemoteFile) -> None:
    sftp = conn.sftp()
    path = f"{files.remote_dir}/{f.name}"
    parent = path.rsplit("/", 1)[0]
    if parent != files.remote_dir:
        run(conn, f"umask 077; mkdir -p {shlex.quote(parent)}")
    tmp = f"{path}.spotctl-tmp"
    # Mode first, content second: the file is never readable by others, even briefly
    # (and the node directory itself is 0700).
    with sftp.open(tmp, "wb") as fh:
        sftp.chmod(tmp, f.mode)
        fh.set_pipelined(True)  # no round trip per 32 KiB: wheels upload at line speed
        fh.write(f.content)
    sftp.posix_rename(tmp, path)


def _parse_result(stdout: str) -> dict[str, str]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("spotctl-result "):
            return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    return {}


def _bootstrap(
    target: HostTarget,
    render: Callable[[HostTarget], BootstrapFiles],
    known_hosts: Path,
    opts: _Opts,
) -> tuple[HostResult, HostTarget, float | None]:
    conn = connect(
        target, known_hosts, wait_s=opts.wait_s, attempt_timeout_s=opts.attempt_timeout_s
    )
    try:
        target = _resolve_dir(conn, target)
        if opts.choose_python is not None:
            chosen = opts.choose_python(conn, target)
            log.info("%s: venv from %s (%s%s%s%s)", target.label, chosen.path, chosen.py,
                     f", torch {chosen.torch}" if chosen.torch_ok() else "",
                     "" if chosen.ensurepip else ", no ensurepip: pip from its wheel",
                     ", older than some pins allow: older releases from its index"
                     if chosen.older else "")
            target = dataclasses.replace(target, python=chosen.path, older_pins=chosen.older)
        files = render(target)
        sums = _remote_sums(conn, target, files)
        uploaded: list[str] = []
        sent = 0
        restart = False
        for f in files.files:
            if sums.get(f.name) != f.sha256:
                _upload(conn, files, f)
                uploaded.append(f.name)
                sent += len(f.content)
                restart = restart or f.restarts_agent
        if uploaded:
            log.info("%s: uploaded %d files, %d bytes", target.label, len(uploaded), sent)
        baseline = opts.probe.last_heartbeat(target.node_id) if opts.probe else None
        script = shlex.quote(f"{files.remote_dir}/{SCRIPT}")
        cmd = f"sh {script} ensure{' restart' if restart else ''}"
        r = _check(target, "bootstrap script", run(conn, cmd, opts.command_timeout_s))
        result = _parse_result(r.stdout)
        if not result:
            raise BootstrapError(f"{target.label}: bootstrap script gave no result line")
        started = result.get("agent") == "started"
        agent = "running"
        if started:
            agent_lines = [ln for ln in r.stdout.splitlines() if ln.startswith("spotctl: agent")]
            agent = "started " + (agent_lines[-1].split("agent ", 1)[-1] if agent_lines else "")
        changed = bool(uploaded) or result.get("installed") == "1" or started
    finally:
        conn.close()
    notes = [worker_fallback_note(r.stdout), _old_torch_note(r.stdout)]
    if target.older_pins:
        notes.append("its Python is older than some of this controller's pins allow: it took "
                     "older releases of those from its package index")
    note = "; ".join(n for n in notes if n)
    res = HostResult(target.node_id, True, "", changed, 0.0, agent.strip(), uploaded, sent,
                     note)
    return res, target, baseline


def _old_torch_note(stdout: str) -> str:
    """The bootstrap's line when the image's torch was too old to use (templates/
    bootstrap.sh): the node downloaded the pinned torch instead, which the user should
    know (a multi-GB download on every such node)."""
    for line in stdout.splitlines():
        m = re.match(r"spotctl: (.+) has torch (\S+), older than (\S+): installing (\S+)$", line)
        if m:
            return (f"the image's torch ({m[1]}) is {m[2]}, older than {m[3]}: it got "
                    f"{m[4]} instead")
    return ""


def worker_fallback_note(stdout: str) -> str:
    """What the bootstrap said when training workers could not run as `[train] run_as`
    (no root through sudo, or that user cannot run the interpreter): they then run as the
    login user and can read the node's credential, which the user should be told, not
    find in a node log. "" when they run as run_as, or none was asked for."""
    lead = "spotctl: workers run as "
    for line in reversed(stdout.splitlines()):
        if line.startswith(lead) and ": " in line[len(lead):]:
            who, _, why = line[len(lead):].partition(": ")
            return (f"training workers run as {who}, not [train] run_as ({why}): they can "
                    "read the node's credential")
    return ""


def release_hosts(
    hosts: list[HostTarget], known_hosts: Path, parallel: int = 8, *, wait_s: float = 0.0
) -> list[HostResult]:
    """Stop the agent, disable its unit and delete the token on each host. Never powers
    anything off. A host whose node directory holds no bootstrap script is already clean."""

    def one(t: HostTarget) -> HostResult:
        t0 = time.monotonic()
        try:
            conn = connect(t, known_hosts, wait_s=wait_s)
            try:
                t = _resolve_dir(conn, t)
                s = shlex.quote(f"{t.remote_dir}/{SCRIPT}")
                r = run(conn, f"if [ -f {s} ]; then sh {s} release; else echo absent; fi", 300)
                _check(t, "release", r)
            finally:
                conn.close()
            return HostResult(t.node_id, True, "", "absent" not in r.stdout, time.monotonic() - t0)
        except Exception as e:
            reason = str(e) if isinstance(e, BootstrapError) else f"{type(e).__name__}: {e}"
            return HostResult(t.node_id, False, reason, False, time.monotonic() - t0)

    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(hosts)))) as pool:
        return list(pool.map(one, hosts))


def default_python() -> str:
    """The controller's interpreter: right for loopback and for hosts that mirror it."""
    return sys.executable


# Where each log lives in a node directory: the agent's own output, torchrun's (in the
# agent's workdir), and the bootstrap's install log (what "node.log" is for a local node).
REMOTE_LOGS = {"agent.log": "agent.log", "torchrun.log": "work/torchrun.log",
               "node.log": "bootstrap.log"}  # fmt: skip


def tail_node_log(
    store: Store, cluster: str, row: NodeRow, log_name: str, follow: bool, lines: int
) -> None:
    """`spotctl logs NODE` for a node reached over SSH (host key pinned per cluster)."""
    from spotctl.remote.ssh import tail_log, target_from_node

    target = target_from_node(row)
    d = target.remote_dir or f".spotctl/{row.id}"  # relative: under the remote $HOME
    rel = REMOTE_LOGS.get(log_name, log_name)
    tail_log(
        target, f"{d.rstrip('/')}/{rel}", store.cluster_dir(cluster).known_hosts,
        follow=follow, lines=lines,
    )  # fmt: skip


# ---- cloud nodes (aws, gcp): the head VM and the workers, reached over SSH --------------

# Test seam, for `up -> status -> down` against a fake cloud (moto, fake Compute) on one
# machine: every instance, head included, is reached over SSH at one loopback sshd instead
# of its (fake) address, and the head's coordinator/store listen there too. Never set it
# for a real cloud.
#   SPOTCTL_SSH_OVERRIDE="127.0.0.1:PORT"    where every instance's SSH goes
#   SPOTCTL_SSH_OVERRIDE_KEY=/path/key       private key for it (default: the cluster's)
#   SPOTCTL_SSH_OVERRIDE_USER=name           login (default: the current user)
#   SPOTCTL_HEAD_PORTS="API:STORE[:LH]"      head's coordinator and store ports (and its
#                                            torchft Lighthouse's, for engine torchft)
#   SPOTCTL_METADATA_URL="http://127.0.0.1:PORT/{node}"   where the agents poll for notices
#                                            ({node}: the node id) instead of the cloud's
#                                            metadata service; honoured only with the override
# ProviderContext.options "ssh_override", "ssh_override_key", "ssh_override_user",
# "head_api_port", "head_store_port", "head_lighthouse_port" win over the environment.
OVERRIDE_VAR = "SPOTCTL_SSH_OVERRIDE"
OVERRIDE_KEY_VAR = "SPOTCTL_SSH_OVERRIDE_KEY"
OVERRIDE_USER_VAR = "SPOTCTL_SSH_OVERRIDE_USER"
HEAD_PORTS_VAR = "SPOTCTL_HEAD_PORTS"
METADATA_URL_VAR = "SPOTCTL_METADATA_URL"
# Node directories on the hosts; relative = under the remote user's $HOME (as for `ssh`).
REMOTE_ROOT_VAR = "SPOTCTL_SSH_REMOTE_ROOT"
HEAD_NODE_ID = "head"
# The head's torchft Lighthouse (engine torchft), torchft's own default port. Like the
# store it has no authentication: the clouds' rules open it to cluster members only.
LIGHTHOUSE_PORT = 29510


@dataclass(frozen=True)
class SshOverride:
    """Where every instance's SSH really goes (the test seam above)."""

    address: str  # e.g. "127.0.0.1": also where the head listens and nodes meet
    port: int
    user: str  # "" = the instance's own ssh_user
    key_path: str  # "" = the instance's own key (meta["key_file"])


def ssh_override(options: Mapping[str, Any]) -> SshOverride | None:
    import os

    raw = str(options.get("ssh_override") or os.environ.get(OVERRIDE_VAR) or "")
    if not raw:
        return None
    host, _, port = raw.rpartition(":")
    if not host or not port.isdigit():
        raise BootstrapError(f"{OVERRIDE_VAR}: expected HOST:PORT, got {raw!r}")
    user = str(options.get("ssh_override_user") or os.environ.get(OVERRIDE_USER_VAR) or "")
    if not user:
        import getpass

        user = getpass.getuser()
    key = str(options.get("ssh_override_key") or os.environ.get(OVERRIDE_KEY_VAR) or "")
    return SshOverride(host.strip("[]"), int(port), user, key)


def _head_ports_env() -> list[int]:
    import os

    raw = os.environ.get(HEAD_PORTS_VAR, "")
    if not raw:
        return []
    parts = raw.split(":")
    if len(parts) not in (2, 3) or not all(x.isdigit() for x in parts):
        raise BootstrapError(f"{HEAD_PORTS_VAR}: expected API:STORE[:LIGHTHOUSE] ports, "
                             f"got {raw!r}")  # fmt: skip
    return [int(x) for x in parts]


def head_ports(options: Mapping[str, Any], api: int, store: int) -> tuple[int, int]:
    """The head's (coordinator, store) ports: options, then SPOTCTL_HEAD_PORTS, then defaults."""
    env = _head_ports_env()
    if env:
        api, store = env[0], env[1]
    return int(options.get("head_api_port", api)), int(options.get("head_store_port", store))


def head_lighthouse_port(options: Mapping[str, Any], default: int = LIGHTHOUSE_PORT) -> int:
    """The head's torchft Lighthouse port: options, then SPOTCTL_HEAD_PORTS's third, then
    `default`."""
    env = _head_ports_env()
    if len(env) == 3:
        default = env[2]
    return int(options.get("head_lighthouse_port", default))


def controller_url(head: HeadInfo, known_hosts: Path) -> str:
    """The URL this process uses for the head's API: a tunnel when the head needs one."""
    if head.tunnel:
        from spotctl.remote.tunnel import local_url

        return local_url(head.tunnel, known_hosts)
    return head.public_url or head.url


def package_extras(spec: Any) -> tuple[str, ...]:
    """spotctl's extras in the package every node and the head install: torchft (`ft`) on
    engine torchft; the cloud's client (`aws`, `gcp`) where the head runs the reconcile
    loop."""
    extras: tuple[str, ...] = ("ft",) if spec.train.engine == "torchft" else ()
    if spec.head_rebalances and spec.provider in ("aws", "gcp"):
        extras += (spec.provider,)
    return extras


class CloudNodes:
    """Bootstrap of cloud instances, shared by the aws and gcp providers.

    The head VM gets the same bootstrap as a worker (upload, install if missing, systemd or
    setsid), with `spotctl head` as the supervised command instead of the agent; workers get
    an agent whose notices come from the cloud's metadata service.

    How the controller reaches the coordinator: `HeadInfo.public_url`, which the providers
    set to the head's public address (reconcile.head_client prefers it). Under the test seam
    everything is on the override address (loopback).
    """

    def __init__(
        self,
        ctx: ProviderContext,
        *,
        metadata: str,
        metadata_url: str,
        api_port: int,
        store_port: int,
        lighthouse_port: int = LIGHTHOUSE_PORT,
    ):
        import os

        opts = ctx.options
        self.ctx = ctx
        self.metadata = metadata
        self.metadata_url = metadata_url
        self.override = ssh_override(opts)
        self.api_port, self.store_port = head_ports(opts, api_port, store_port)
        # engine torchft: the head also runs torchft's Lighthouse, on this port
        self.torchft = ctx.spec.train.engine == "torchft"
        self.lighthouse_port = head_lighthouse_port(opts, lighthouse_port)
        self.remote_root = str(
            opts.get("ssh_remote_root") or os.environ.get(REMOTE_ROOT_VAR) or ".spotctl"
        )
        self.wait_s = float(opts.get("ssh_wait_s", 300.0))
        self.heartbeat_timeout_s = float(opts.get("ssh_heartbeat_timeout_s", 180.0))
        self.head_timeout_s = float(opts.get("head_start_timeout_s", 120.0))
        # SSH work only: heartbeats are awaited outside these slots (bootstrap_hosts).
        self.parallel = int(opts.get("ssh_parallel", 32))
        # On a VM: spotctl ships itself (its wheel, pinned dependencies, the project) into
        # a venv made from the image's python, which `[train] python` names (default
        # python3; e.g. a Deep Learning image's torch environment), so that image's CUDA
        # torch is reused. On the test seam's loopback host: this interpreter as it is.
        py = ctx.spec.train.python
        self.deliver = bool(opts.get("deliver", self.override is None))
        self.python = py or str(opts.get("base_python") or "") or (
            "python3" if self.deliver else sys.executable
        )
        self._pkg: tuple[NodePackage, Project | None] | None = None
        # the head's own reconcile loop ([rebalance] on_head): it runs on the head VM, SSHes
        # to the nodes' private addresses, and installs them from what the head was given
        self.on_head = str(opts.get("on_head") or "")
        self.head_node_dir = str(opts.get("head_node_dir") or "")

    @property
    def known_hosts(self) -> Path:
        return self.ctx.cluster_dir.known_hosts

    def package(self) -> tuple[NodePackage | None, Project | None]:
        """What the nodes install from (None, None when not delivering); built once."""
        if not self.deliver:
            return None, None
        if self._pkg is None and self.on_head:
            self._pkg = self._head_package()
        if self._pkg is None:
            from spotctl.remote.package import node_package, packages_for, project_files

            cache = self.ctx.cluster_dir.home / "cache" / "package"
            script = Path(self.ctx.spec.train.script)
            project = project_files(script.resolve().parent) if script.is_file() else None
            also = packages_for(self.ctx.spec.train.checkpoint_dir)
            self._pkg = (node_package(cache, extras=package_extras(self.ctx.spec), also=also),
                         project)
            log.info("%s%s", self._pkg[0].summary(),
                     f"; {project.summary()}" if project else "")  # fmt: skip
        return self._pkg

    def _head_package(self) -> tuple[NodePackage, Project | None]:
        """On the head: the package and project `up` uploaded into the head's directory."""
        d = Path(self.head_node_dir)
        if not (d / PKG_DIR / "key").is_file():
            raise BootstrapError(f"the head has no node package in {d / PKG_DIR}")
        package = NodePackage.from_dir(d / PKG_DIR)
        project = None
        root = d / PROJECT_DIR
        try:
            bundle = json.loads((d / BUNDLE).read_text())
        except (OSError, ValueError):
            bundle = {}
        if root.is_dir() and bundle.get("project_root"):
            files = {p.relative_to(root).as_posix(): p.read_bytes()
                     for p in sorted(root.rglob("*")) if p.is_file()}
            project = Project(Path(bundle["project_root"]), files)
        return package, project

    def token(self) -> str:
        return self.ctx.cluster_dir.token(create=True)

    def choose_python(self, package: NodePackage | None) -> PythonChooser | None:
        """Each VM is asked for its interpreters first; `[train] python` set names the
        only one, else the image's torch environments come before python3."""
        if self.ctx.spec.train.python:
            return python_chooser(package, (), self.python)
        return python_chooser(package, self.ctx.spec.train.torch_envs, self.python)

    def target(self, inst: Instance, node_id: str = "") -> HostTarget:
        node_id = node_id or inst.id
        remote_dir = f"{self.remote_root.rstrip('/')}/{self.ctx.cluster}/{node_id}"
        key = str(inst.meta.get("key_file") or "")
        ov = self.override
        if ov is not None:
            return HostTarget(node_id, ov.address, ov.port, ov.user or inst.ssh_user,
                              ov.key_path or key, remote_dir)  # fmt: skip
        # from the head (inside the cluster's network): the private address
        address = inst.address if self.on_head else (inst.public_address or inst.address)
        if not address:
            raise BootstrapError(f"{node_id}: instance {inst.id} has no address to SSH to")
        return HostTarget(node_id, address, inst.ssh_port, inst.ssh_user, key, remote_dir)

    # -- the head
    def head_info(self, inst: Instance) -> HeadInfo:
        """Where the head on this VM listens: private address for nodes, public for us."""
        host = self.override.address if self.override else inst.address
        # the Lighthouse listens where the store does (the nodes' side of the head)
        lighthouse = f"http://{host}:{self.lighthouse_port}" if self.torchft else ""
        if self.on_head:  # the head's own loop reaches its API where the nodes do
            return HeadInfo(url=f"http://{host}:{self.api_port}", store_host=host,
                            store_port=self.store_port, instance_id=inst.id,
                            lighthouse=lighthouse)  # fmt: skip
        if self.override:
            # test seam: the "VM" is this machine, its API is reachable directly
            public = self.override.address
            return HeadInfo(
                url=f"http://{host}:{self.api_port}", store_host=host,
                store_port=self.store_port, instance_id=inst.id,
                public_url=f"http://{public}:{self.api_port}", lighthouse=lighthouse,
            )  # fmt: skip
        # On a cloud the API port is open only inside the cluster: the controller goes
        # through an SSH forward to the head VM (spotctl.remote.tunnel), host key pinned.
        t = self.target(inst, HEAD_NODE_ID)
        return HeadInfo(
            url=f"http://{host}:{self.api_port}", store_host=host, store_port=self.store_port,
            instance_id=inst.id, tunnel={"address": t.address, "port": t.port, "user": t.user,
                                         "key_file": t.key_path, "remote_port": self.api_port,
                                         "remote_host": host},
            lighthouse=lighthouse,
        )  # fmt: skip

    def head_listen(self, info: HeadInfo) -> str:
        """Where the head binds its API, store and Lighthouse: the head VM's private
        address, never every interface. The store and the Lighthouse have no
        authentication: the security group / firewall admits the cluster's members only,
        and the controller comes through an SSH forward to that address."""
        return self.override.address if self.override else info.store_host

    def start_head(self, inst: Instance, info: HeadInfo) -> HostResult:
        """Run `spotctl head` on the head VM (idempotent), token uploaded 0600; ok once the
        coordinator answers /api/health at the URL the controller uses."""
        token = self.token()
        listen = self.head_listen(info)
        package, project = self.package()

        def render(t: HostTarget) -> BootstrapFiles:
            d = t.remote_dir
            base = t.python or self.python  # the interpreter the probe chose there
            py = node_venv(d, package, base) + "/bin/python" if package else self.python
            cfg = AgentConfig(
                cluster=self.ctx.cluster, node_id=HEAD_NODE_ID, head_url=info.url,
                store_host=info.store_host, store_port=info.store_port, token_file="",
                workdir="work", script="",
            )  # fmt: skip
            # `-X` tags the command line with the node's agent.json path, which is how
            # bootstrap.sh recognises its own process (python ignores unknown -X options).
            argv = [py, "-X", f"spotctl_node={d}/{AGENT_CONFIG}", "-m",
                    "spotctl.cli.app", "head", "--dir", f"{d}/head", "--token-file",
                    f"{d}/{TOKEN_FILE}", "--host", listen, "--http-port", str(self.api_port),
                    "--store-port", str(self.store_port)]  # fmt: skip
            if self.torchft:  # torchft's Lighthouse, in the head process, bound like the store
                argv += ["--lighthouse-port", str(self.lighthouse_port)]
            if self.ctx.spec.head_rebalances:  # the cluster's reconcile loop, on the head
                argv += ["--rebalance-bundle", f"{d}/{BUNDLE}"]
            loop = self.ctx.spec.head_rebalances
            # the head hands the project on to the nodes it replaces, and runs none of it
            files = render_bootstrap(t, cfg, token, python=self.python, agent_argv=argv,
                                     package=package, project=project if loop else None,
                                     project_restarts=False)  # fmt: skip
            if loop:
                # read by the loop when it changed: a new one does not restart the head
                files.files.append(RemoteFile(BUNDLE, self.bundle(inst, info),
                                              0o600, restarts_agent=False))
            return files

        target = self.target(inst, HEAD_NODE_ID)
        (res,) = bootstrap_hosts([target], render, self.known_hosts, 1, None,
                                 wait_s=self.wait_s,
                                 choose_python=self.choose_python(package))  # fmt: skip
        if not res.ok:
            return res
        url = controller_url(info, self.known_hosts)
        deadline = time.monotonic() + self.head_timeout_s
        while not _head_healthy(url, token):
            if time.monotonic() >= deadline:
                return dataclasses.replace(
                    res,
                    ok=False,
                    reason=(
                        f"{target.label}: head started but {url}/api/health did not answer "
                        f"within {self.head_timeout_s:.0f}s (see head/ in {target.remote_dir})"
                    ),
                )
            time.sleep(0.3)
        if self.torchft and not self._lighthouse_up(target, deadline):
            return dataclasses.replace(res, ok=False, reason=(
                f"{target.label}: head started without torchft's Lighthouse (engine torchft; "
                f"is torchft installed there? see head/ in {target.remote_dir})"))  # fmt: skip
        return res

    def checkpoint_dir(self) -> str:
        """Where the nodes keep checkpoints: the spec's, else the cluster directory's."""
        return self.ctx.spec.train.checkpoint_dir or str(self.ctx.cluster_dir.checkpoints)

    def bundle(self, inst: Instance, info: HeadInfo) -> bytes:
        """What the head's reconcile loop needs to act for this cluster: the spec, where
        the head is, the cluster's SSH key and pinned host keys, the project's path
        (spotctl.head.rebalancer.import_bundle). No cloud credentials: the head VM's
        own role is scoped to this cluster. Under the test seam, the seam's settings."""
        import os

        cdir = self.ctx.cluster_dir.path
        files = {}
        key = Path(str(inst.meta.get("key_file") or ""))
        if key.is_file() and cdir in key.parents:  # e.g. ssh/id_ed25519 (gcp)
            files[key.relative_to(cdir).as_posix()] = key.read_text()
        if self.known_hosts.is_file():
            files[self.known_hosts.name] = self.known_hosts.read_text()
        script = Path(self.ctx.spec.train.script)
        env = {}
        if self.override is not None:
            env = {k: v for k, v in os.environ.items()
                   if k.startswith("SPOTCTL_") and k != "SPOTCTL_HOME"
                   or k in ("AWS_ENDPOINT_URL", "AWS_EC2_METADATA_SERVICE_ENDPOINT")}
        head = {"url": info.url, "store_host": info.store_host, "store_port": info.store_port,
                "instance_id": inst.id, "lighthouse": info.lighthouse}
        spec = self.ctx.spec.model_dump(mode="json")
        # the nodes' checkpoints, as the controller gave them (on a cloud, the bucket)
        spec["train"]["checkpoint_dir"] = self.checkpoint_dir()
        return (json.dumps({
            "cluster": self.ctx.cluster, "provider": self.ctx.spec.provider,
            "spec": spec, "head": head, "files": files,
            "interval_s": self.ctx.spec.rebalance.on_head_interval_s,
            "project_root": str(script.resolve().parent) if script.is_file() else "",
            "env": env,
        }, indent=1, sort_keys=True) + "\n").encode()  # fmt: skip

    def _lighthouse_up(self, target: HostTarget, deadline: float) -> bool:
        """Whether the head on `target` records a running Lighthouse (its head.json; the
        port itself is open to cluster members only, not to this controller)."""
        deadline = max(deadline, time.monotonic() + 10.0)
        path = shlex.quote(f"{target.remote_dir.rstrip('/')}/head/head.json")
        conn = connect(target, self.known_hosts, wait_s=self.wait_s)
        try:
            while True:
                r = run(conn, f"cat {path} 2>/dev/null", timeout_s=30)
                try:
                    if json.loads(r.stdout or "{}").get("lighthouse"):
                        return True
                except ValueError:
                    pass  # being rewritten
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.5)
        finally:
            conn.close()

    def head(self, inst: Instance, start: bool, cloud: str) -> HeadInfo:
        """Where the head on this VM is; with `start`, run it there first (or raise)."""
        info = self.head_info(inst)
        if start:
            res = self.start_head(inst, info)
            if not res.ok:
                raise BootstrapError(f"{cloud}: head {inst.id}: {res.reason}")
        return info

    # -- workers
    def agent_config(self, inst: Instance, head: HeadInfo) -> AgentConfig:
        """The node's agent config; token_file and workdir are placed by the bootstrap."""
        spec = self.ctx.spec
        tr = spec.train
        return AgentConfig(
            cluster=self.ctx.cluster, node_id=inst.id, head_url=head.url,
            store_host=head.store_host, store_port=head.store_port, token_file="",
            workdir="work", script=tr.script, args=list(tr.args),
            nproc_per_node=max(1, inst.gpus),
            max_nodes=max(1, spec.gpus.max // max(1, inst.gpus)),
            checkpoint_dir=self.checkpoint_dir(),
            checkpoint_every=tr.checkpoint_every, checkpoint_every_s=tr.checkpoint_every_s,
            keep_last=tr.keep_last, checkpoint_writers=tr.checkpoint_writers,
            max_steps=tr.max_steps, python=tr.python,
            # what the node's network needs (e.g. FI_PROVIDER=efa on an EFA node, from the
            # provider), then the spec's own, which wins
            env={**dict(inst.meta.get("node_env") or {}), **tr.worker_env()},
            local_addr=self.override.address if self.override else inst.address,
            metadata=self.metadata, metadata_url=self.node_metadata_url(inst.id),
            run_as=tr.run_as, engine=tr.engine, replica_nodes=tr.nodes_per_replica,
            lighthouse=head.lighthouse if tr.engine == "torchft" else "",
            # a cloud GPU type: no worker starts before its GPUs answer. Under the test
            # seam the "instances" are processes on this CPU machine: no gate there.
            expect_gpus=0 if self.override else max(0, inst.gpus), gpu_wait_s=tr.gpu_wait_s,
        )  # fmt: skip

    def node_metadata_url(self, node_id: str) -> str:
        """The cloud's metadata service; under the test seam, SPOTCTL_METADATA_URL's."""
        import os

        seam = os.environ.get(METADATA_URL_VAR, "") if self.override is not None else ""
        return seam.replace("{node}", node_id) if seam else self.metadata_url

    def bootstrap(
        self, instances: Sequence[Instance], head: HeadInfo, *,
        progress: HostProgress | None = None, failed: Sequence[HostResult] = (),
    ) -> list[HostResult]:
        """Agents on the workers; a host is ok once its agent heartbeats at the head.
        `failed`: hosts the provider already gave up on (never running, no address); they
        come first in the results and in the progress count."""
        total = len(failed) + len(instances)
        for i, r in enumerate(failed, 1):
            if progress is not None:
                progress(r, i, total)

        def each(r: HostResult, n: int, _total: int) -> None:
            if progress is not None:
                progress(r, len(failed) + n, total)

        package, project = self.package()
        n = len(instances)
        return list(failed) + bootstrap_agents(
            instances, {i.id: self.target(i) for i in instances},
            lambda i: start_together(self.agent_config(i, head), n), self.token(),
            self.known_hosts,
            python=self.python, probe_url=controller_url(head, self.known_hosts),
            parallel=self.parallel, progress=each, wait_s=self.wait_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s, package=package, project=project,
            choose_python=self.choose_python(package),
        )  # fmt: skip

    def release(self, instances: Sequence[Instance]) -> list[HostResult]:
        """Stop agents (and the head) on these instances over SSH; the head is role=head."""
        targets = [self.target(i, HEAD_NODE_ID if i.role == "head" else "") for i in instances]
        return release_hosts(targets, self.known_hosts, self.parallel, wait_s=10.0)


def _head_healthy(url: str, token: str) -> bool:
    req = urllib.request.Request(
        url.rstrip("/") + "/api/health", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urlopen_direct(req, timeout=3) as r:
            return bool(json.load(r).get("ok"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def bootstrap_agents(
    instances: Sequence[Instance],
    targets: Mapping[str, HostTarget],
    config_for: Callable[[Instance], AgentConfig],
    token: str,
    known_hosts: Path,
    *,
    python: str,
    probe_url: str = "",
    upload_script: bool = True,
    parallel: int = 8,
    progress: HostProgress | None = None,
    wait_s: float = 300.0,
    heartbeat_timeout_s: float = 120.0,
    package: NodePackage | None = None,
    project: Project | None = None,
    choose_python: PythonChooser | None = None,
) -> list[HostResult]:
    """Make instances nodes: render each one's agent config (the training script uploaded
    next to it when it is a local file, or the whole `project`), bootstrap (installing from
    `package` when given, `python` being then the image's interpreter), and with
    `probe_url` wait for each agent's first heartbeat at the head. Per-host results; never
    raises for one host."""
    by_id = {i.id: i for i in instances}

    def render(t: HostTarget) -> BootstrapFiles:
        cfg = dataclasses.replace(config_for(by_id[t.node_id]))
        extra: dict[str, bytes] = {}
        script = Path(cfg.script)
        if upload_script and script.is_file() and project is None:
            extra[f"train/{script.name}"] = script.read_bytes()
            cfg.script = f"{t.remote_dir}/train/{script.name}"
        # the node gets its own credential (bound to its id), never the cluster secret
        return render_bootstrap(t, cfg, node_token(token, cfg.node_id), python=python,
                                extra=extra, package=package, project=project)

    probe = HeadProbe(probe_url, token) if probe_url else None
    return bootstrap_hosts(
        [targets[i.id] for i in instances], render, known_hosts, parallel, progress,
        wait_s=wait_s, probe=probe, heartbeat_timeout_s=heartbeat_timeout_s,
        choose_python=choose_python,
    )  # fmt: skip
