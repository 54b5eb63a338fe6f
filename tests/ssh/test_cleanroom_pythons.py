"""Clean room with node images as they are: the node's python3 is not the controller's
(Python 3.10, as on Ubuntu 22.04), no interpreter on it has `ensurepip` (no python3-venv),
and torch lives in a separate environment of the image (as the Deep Learning AMI keeps it
in /opt/pytorch), here on another installation of the controller's Python.

The interpreters are copies of this machine's pyenv builds without their `ensurepip`
package (and without tests or site-packages), their library path made relative so that a
throwaway account can run them. The host is that account behind a real sshd on loopback.

- probed first, the node's 3.10 is passed over (some shipped pins need >= 3.11) for its
  torch environment; the venv is made without pip, pip comes from the uploaded wheel,
  torch is the environment's (nothing downloaded), and training runs;
- with only the 3.10 on the node, that Python takes the newest releases up to the
  controller's pins that it allows from its package index (a loopback index made by
  scripts/node-wheels), and spotctl runs on it.
"""

from __future__ import annotations

import http.server
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO
from .test_cleanroom import (
    HOME,
    USER,
    _as_user,
    _ensure_user,
    _procs,
    _sshd_for_user,
    link_torch,
)

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.usefixtures("cleanroom_account")]

SPOTCTL = [sys.executable, "-m", "spotctl.cli.app"]
ROOT = Path("/opt/spotctl-cleanroom")
PYENV = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv")) / "versions"
OLD = ROOT / "py310"  # the node's python3: not the controller's Python, no ensurepip
SAME = ROOT / "py311"  # the image's torch environment is made from this one (no ensurepip)
TORCH_ENV = ROOT / "torch-env"


def _as_node(*argv: str) -> subprocess.CompletedProcess[str]:
    """As the host account, with nothing of this process's import path."""
    return _as_user("env", "-u", "PYTHONPATH", *argv)


def _pyenv(major_minor: str) -> Path | None:
    found = sorted(PYENV.glob(f"{major_minor}.*")) if PYENV.is_dir() else []
    return found[-1] if found else None


def _copy_python(src: Path, dst: Path, ver: str) -> Path:
    """`src`'s interpreter without ensurepip, runnable by any user."""
    exe = dst / "bin" / "python3"
    if exe.exists():
        return exe
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "bin").mkdir(parents=True)
    skip = shutil.ignore_patterns("test", "ensurepip", "site-packages", "idlelib", "tkinter",
                                  "turtledemo", "lib2to3", "__pycache__", "config-*")
    shutil.copytree(src / "lib", tmp / "lib", ignore=skip, symlinks=True)
    (tmp / "lib" / f"python{ver}" / "site-packages").mkdir()
    data = (src / "bin" / f"python{ver}").read_bytes()
    old = str(src / "lib").encode()  # pyenv's RUNPATH: under /root, closed to others
    new = b"$ORIGIN/../lib"
    assert data.count(old) == 1 and len(new) <= len(old)
    (tmp / "bin" / f"python{ver}").write_bytes(data.replace(old, new.ljust(len(old), b"\0")))
    (tmp / "bin" / f"python{ver}").chmod(0o755)
    (tmp / "bin" / "python3").symlink_to(f"python{ver}")
    subprocess.run(["chmod", "-R", "go+rX", str(tmp)], check=True)
    tmp.rename(dst)
    return exe


def _torch_env(base: Path) -> Path:
    """A venv of `base` (made without pip: there is no ensurepip) holding torch and its
    dependencies, linked from this project's venv, and nothing of spotctl's."""
    py = TORCH_ENV / "bin" / "python3"
    if not py.exists():
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(TORCH_ENV)], check=True)
    link_torch(py)
    subprocess.run(["chmod", "-R", "go+rX", str(TORCH_ENV)], check=True)
    return py


@pytest.fixture
def node_pythons() -> tuple[str, str]:
    """(the node's python3: 3.10, no ensurepip; the image's torch environment)."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("needs root with useradd and runuser to make a throwaway host account")
    old, same = _pyenv("3.10"), _pyenv(f"{sys.version_info[0]}.{sys.version_info[1]}")
    if old is None or same is None or sys.version_info[:2] == (3, 10):
        pytest.skip(f"needs pyenv's Python 3.10 and {sys.version_info[0]}."
                    f"{sys.version_info[1]} under {PYENV}")
    ROOT.mkdir(parents=True, exist_ok=True)
    os.chmod(ROOT, 0o755)
    py310 = _copy_python(old, OLD, "3.10")
    same_py = _copy_python(same, SAME, f"{sys.version_info[0]}.{sys.version_info[1]}")
    torch_py = _torch_env(same_py)
    _ensure_user()
    shutil.rmtree(HOME / ".spotctl", ignore_errors=True)
    shutil.rmtree(HOME / "ckpt", ignore_errors=True)  # an earlier run's: no resuming from it
    for p in (py310, torch_py):
        assert _as_node(str(p), "-c", "import ensurepip").returncode != 0  # like python3 on
        assert _as_node(str(p), "-m", "venv", str(HOME / "v")).returncode != 0  # Ubuntu
    assert _as_node(str(py310), "-c", "import sys; assert sys.version_info[:2] == (3, 10)"
                    ).returncode == 0
    assert _as_node(str(torch_py), "-c", "import torch").returncode == 0
    assert _as_node(str(torch_py), "-c", "import spotctl").returncode != 0
    shutil.rmtree(HOME / "v", ignore_errors=True)
    return str(py310), str(torch_py)


def _project(tmp_path: Path, port: int, key: Path, base: str, envs: list[str]) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "templates" / "train.py", project / "train.py")
    ckpt = HOME / "ckpt"
    (project / "spotctl.toml").write_text(
        'name = "pyclean"\nprovider = "ssh"\ngpus = "1"\n\n'
        '[train]\nscript = "train.py"\nengine = "torchrun"\ncheckpoint_every = 5\n'
        f'checkpoint_dir = "{ckpt}"\nrun_as = ""\ntorch_envs = {json.dumps(envs)}\n'
        'env = { TRAIN_STEP_SLEEP_S = "0.05" }\n\n'
        f'[ssh]\nbase_python = "{base}"\ndedicated_hosts = true\n\n'
        f'[[ssh.hosts]]\naddress = "127.0.0.1"\nport = {port}\nuser = "{USER}"\n'
        f'key = "{key}"\n'
    )
    return project


def _cli(project: Path, env: dict[str, str], *args: str,
         timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SPOTCTL, *args], cwd=project, env=env, text=True,
                          capture_output=True, timeout=timeout)  # fmt: skip


def _cleanup(project: Path, env: dict[str, str], factory: Any, home: Path) -> None:
    if (home / "state.db").exists():
        _cli(project, env, "down", "--name", "pyclean", "--yes")
    for pid in _procs(str(HOME / ".spotctl")) + _procs(str(home)):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    factory.stop_all()
    shutil.rmtree(factory.base, ignore_errors=True)


def _cluster(tmp_path: Path, port: int, key: Path, base: str,
             envs: list[str]) -> tuple[Path, dict[str, str], Path, Path]:
    """(the project, the CLI's environment, its state dir, the node's directory) of a
    one-host cluster on the host account behind `port`."""
    project = _project(tmp_path, port, key, base, envs)
    home = tmp_path / "home"
    env = dict(os.environ, SPOTCTL_HOME=str(home), NO_COLOR="1")
    env.pop("SPOTCTL_SSH_REMOTE_ROOT", None)
    return project, env, home, HOME / ".spotctl" / "pyclean" / f"ssh-127-0-0-1-{port}"


def _node_logs(ndir: Path) -> str:
    logs = [ndir / "bootstrap.log", ndir / "agent.log", ndir / "work" / "torchrun.log"]
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2500:]}"
                     for p in logs if p.exists())  # fmt: skip


def _in_node_venv(ndir: Path, code: str) -> tuple[str, list[str]]:
    """(the node's venv, what `code` printed there, split), run as the host account."""
    vpy = json.loads(_as_node("cat", str(ndir / "agent.json")).stdout)["python"]
    r = _as_node(vpy, "-c", code)
    assert r.returncode == 0, r.stderr
    return str(Path(vpy).parent.parent), r.stdout.split()


def _train_until(project: Path, env: dict[str, str], ndir: Path,
                 done: Callable[[int], bool]) -> None:
    """Poll `status` until `done(step)`, for at most 120 s."""
    deadline = time.monotonic() + 120
    step = 0
    while not done(step):
        assert time.monotonic() < deadline, f"no progress\n{_node_logs(ndir)}"
        time.sleep(1)
        st = json.loads(_cli(project, env, "status", "--name", "pyclean", "--json").stdout)
        step = st.get("step") or 0


def test_node_python_is_probed_and_its_torch_environment_used(
    node_pythons: tuple[str, str], client_key: Path, tmp_path: Path
) -> None:
    py310, torch_py = node_pythons
    factory, s = _sshd_for_user(client_key)
    project, env, home, ndir = _cluster(tmp_path, s.port, client_key, py310, [torch_py])
    try:
        up = _cli(project, env, "up", "--wait", "120")
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n{_node_logs(ndir)}"
        _train_until(project, env, ndir, lambda step: step >= 6)

        venv, (minor, spotctl_file, torch_file, pip_file) = _in_node_venv(
            ndir, "import sys, spotctl, torch, pip; print(sys.version_info[1]); "
            "print(spotctl.__file__); print(torch.__file__); print(pip.__file__)")
        assert int(minor) == sys.version_info[1]  # the torch environment's Python, not 3.10
        assert spotctl_file.startswith(venv) and pip_file.startswith(venv)
        assert torch_file.startswith(str(TORCH_ENV)) or "/.venv/" in torch_file, torch_file
        assert not torch_file.startswith(venv)  # the image's torch: nothing downloaded
        log = (ndir / "bootstrap.log").read_text()
        assert "Downloading" not in log, log[-2000:]
    finally:
        _cleanup(project, env, factory, home)


@pytest.fixture
def node_index(tmp_path: Path) -> Iterator[list[str]]:
    """The node account's package index: a PEP 503 index on loopback serving what pip, on
    Python 3.10, takes for spotctl's requirements up to this controller's versions
    (scripts/node-wheels, run by scripts/setup-venv), and no torch. Yields the paths asked
    for."""
    wheels = REPO / ".venv" / "node-wheels" / "py3.10"
    assert sorted(wheels.glob("typer-*.whl")), (
        f"{wheels} holds no wheels: run scripts/setup-venv (it runs scripts/node-wheels)")
    yield from _serve_index(tmp_path / "index", sorted(wheels.glob("*.whl")))


def _serve_index(root: Path, wheels: list[Path]) -> Iterator[list[str]]:
    """Serve `wheels` as a PEP 503 index on loopback, the node account's pip index while
    the generator runs; yields the paths asked for."""
    for w in wheels:
        name = re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower()
        (root / "simple" / name).mkdir(parents=True, exist_ok=True)
        (root / "simple" / name / w.name).symlink_to(w)
    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, fmt: str, *args: Any) -> None:
            asked.append(self.path)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    conf = HOME / ".config" / "pip" / "pip.conf"
    _as_node("mkdir", "-p", str(conf.parent))
    r = _as_node("sh", "-c", f"printf '[global]\\nindex-url = http://127.0.0.1:"
                 f"{srv.server_address[1]}/simple/\\n' > {conf}")
    assert r.returncode == 0, r.stderr
    try:
        yield asked
    finally:
        srv.shutdown()
        conf.unlink(missing_ok=True)


def test_a_node_python_older_than_the_pins_takes_older_releases_from_its_index(
    node_pythons: tuple[str, str], node_index: list[str], client_key: Path, tmp_path: Path
) -> None:
    """Only the 3.10 on the node (Ubuntu 22.04 as it is): typer, platformdirs ... as this
    controller has them need 3.11. The node installs spotctl with the newest releases of
    those up to the controller's that 3.10 takes, from its own index, and the controller's
    exact versions of the rest; spotctl runs there. This index has no torch, so `up` then
    stops at torch with one line."""
    from packaging.version import Version

    py310, _ = node_pythons
    factory, s = _sshd_for_user(client_key)
    project = _project(tmp_path, s.port, client_key, py310, [])
    home = tmp_path / "home"
    env = dict(os.environ, SPOTCTL_HOME=str(home), NO_COLOR="1")
    env.pop("SPOTCTL_SSH_REMOTE_ROOT", None)
    try:
        up = _cli(project, env, "up", "--wait", "5")
        assert up.returncode != 0
        out = " ".join((up.stdout + up.stderr).split())  # as one line, whatever the width
        assert "installing torch==2.13.0 failed" in out, out
        assert "Traceback" not in out
        (vpy,) = (HOME / ".spotctl" / "venvs").glob("*/bin/python")
        r = _as_node(str(vpy), "-c", "import sys, json, spotctl, importlib.metadata as md; "
                     "print(json.dumps([list(sys.version_info[:2]), spotctl.__file__, "
                     "{d.metadata['Name'].lower().replace('_', '-'): d.version "
                     "for d in md.distributions()}]))")
        assert r.returncode == 0, r.stderr
        minor, spotctl_file, got = json.loads(r.stdout)
        assert minor == [3, 10] and spotctl_file.startswith(str(vpy.parent.parent))
        mine = {d.metadata["Name"].lower().replace("_", "-"): d.version
                for d in md.distributions()}
        for name in ("typer", "platformdirs"):  # the controller's need 3.11: older ones
            assert Version(got[name]) < Version(mine[name]), (name, got[name], mine[name])
        for name in ("pydantic", "rich", "fabric"):  # these fit 3.10: the same versions
            assert got[name] == mine[name], (name, got[name], mine[name])
        assert all(Version(v) <= Version(mine[n]) for n, v in got.items() if n in mine
                   and n not in ("pip", "spotctl")), got
        assert "tomli" in got  # spotctl's own requirement below 3.11, read on the node
        assert any(p.startswith("/simple/typer/") for p in node_index), node_index
        # spotctl's command line runs on that Python
        r = _as_node(str(vpy), "-m", "spotctl.cli.app", "--help")
        assert r.returncode == 0 and "rebalance" in r.stdout, r.stderr
    finally:
        _cleanup(project, env, factory, home)


OLD_TORCH_ENV = ROOT / "old-torch-env"


def _old_torch_env(base: Path) -> Path:
    """An image's torch environment whose torch is 2.7.1 (a stand-in: its metadata says
    2.7.1 and importing it fails, so a node that uses it cannot train)."""
    py = OLD_TORCH_ENV / "bin" / "python3"
    if not py.exists():
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(OLD_TORCH_ENV)],
                       check=True)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())  # fmt: skip
    (site / "torch").mkdir(exist_ok=True)
    (site / "torch" / "__init__.py").write_text(
        'raise ImportError("the image\'s torch 2.7.1 was used")\n')
    info = site / "torch-2.7.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.7.1\n")
    (info / "RECORD").write_text("")
    subprocess.run(["chmod", "-R", "go+rX", str(OLD_TORCH_ENV)], check=True)
    return py


def _pinned_torch_wheel(out: Path) -> Path:
    """torch-2.13.0-py3-none-any.whl as the node's index serves it, a stand-in for the
    multi-GB build: its metadata is torch 2.13.0's and its one file, a .pth, puts this
    machine's torch (the image torch environment's links, tests/ssh/test_cleanroom.py
    link_torch) on the path."""
    import base64
    import hashlib
    import zipfile

    site = subprocess.run([str(TORCH_ENV / "bin" / "python3"), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    files = {
        "spotctl_test_torch.pth": f"{site}\n",
        "torch-2.13.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n",
        "torch-2.13.0.dist-info/WHEEL": ("Wheel-Version: 1.0\nGenerator: spotctl-tests\n"
                                         "Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append("torch-2.13.0.dist-info/RECORD,,")
    files["torch-2.13.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    whl = out / "torch-2.13.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return whl


@pytest.mark.usefixtures("node_pythons")  # the interpreters; the torch env the wheel links
def test_an_image_torch_older_than_2_9_is_left_unseen_and_the_pinned_torch_installed(
    client_key: Path, tmp_path: Path
) -> None:
    """The node's only interpreter is an image's torch environment with torch 2.7.1 (the
    Deep Learning AMI for PyTorch 2.7 as it is): torchft cannot run there. The node's venv
    must not see that torch: the bootstrap installs the pinned torch from the node's index
    (here a stand-in wheel of torch 2.13.0), `up` says so, and training runs on it."""
    old_py = str(_old_torch_env(SAME / "bin" / "python3"))
    assert _as_node(old_py, "-c", "from importlib import metadata as md; "
                    "assert md.version('torch') == '2.7.1'").returncode == 0
    assert _as_node(old_py, "-c", "import torch").returncode != 0
    index = _serve_index(tmp_path / "index", [_pinned_torch_wheel(tmp_path / "wheels")])
    asked = next(index)
    factory, s = _sshd_for_user(client_key)
    project, env, home, ndir = _cluster(tmp_path, s.port, client_key, old_py, [old_py])
    try:
        up = _cli(project, env, "up", "--wait", "120")
        out = " ".join((up.stdout + up.stderr).split())
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n{_node_logs(ndir)}"
        assert "torch" in out and "is 2.7.1, older than 2.9: it got torch==2.13.0" in out, out
        assert any(p.startswith("/simple/torch/") for p in asked), asked
        # and the workers' own checkpoint, on the node (DCP's .metadata, at commit)
        _train_until(project, env, ndir,
                     lambda step: step >= 6 and any((HOME / "ckpt").glob("*/.metadata")))
        venv, (version, torch_file) = _in_node_venv(
            ndir, "import torch, importlib.metadata as md; print(md.version('torch')); "
            "print(torch.__file__)")
        assert version == "2.13.0"  # the pinned one, installed into the venv
        assert not torch_file.startswith(str(OLD_TORCH_ENV)), torch_file
        assert list((Path(venv) / "lib").glob("python*/site-packages/torch-2.13.0.dist-info"))
    finally:
        _cleanup(project, env, factory, home)
        index.close()


def test_a_driver_too_old_for_the_pinned_torch_stops_the_node_before_the_download(
    client_key: Path, tmp_path: Path, node_pythons: tuple[str, str]
) -> None:
    """The same node with NVIDIA driver 570 (nvidia-smi says so): the pinned torch's CUDA 13
    build cannot use its GPUs, so the bootstrap stops with one line before downloading it."""
    old_py = str(_old_torch_env(SAME / "bin" / "python3"))
    fakebin = ROOT / "driver-570-bin"
    fakebin.mkdir(exist_ok=True)
    (fakebin / "nvidia-smi").write_text(
        '#!/bin/sh\ncase "$*" in *driver_version*) echo "570.133.20";; *) echo "NVIDIA H100";; '
        "esac\n")
    os.chmod(fakebin, 0o755)
    os.chmod(fakebin / "nvidia-smi", 0o755)
    index = _serve_index(tmp_path / "index", [_pinned_torch_wheel(tmp_path / "wheels")])
    asked = next(index)
    factory, s = _sshd_for_user(client_key, f"SetEnv PATH={fakebin}:/usr/local/bin:/usr/bin:/bin\n")
    project, env, home, _ = _cluster(tmp_path, s.port, client_key, old_py, [old_py])
    try:
        up = _cli(project, env, "up", "--wait", "5")
        out = " ".join((up.stdout + up.stderr).split())
        assert up.returncode != 0, out
        assert ("the NVIDIA driver here is 570.133.20; torch==2.13.0 needs 580 or newer: "
                "use an image with torch 2.9 or newer, or a newer driver") in out, out
        assert "Traceback" not in out
        assert not any(p.startswith("/simple/torch") for p in asked), asked  # no download
    finally:
        _cleanup(project, env, factory, home)
        index.close()
