"""Clean-room bootstrap: `spotctl up --provider ssh` onto a host account that has no
spotctl and no venv, only an "image" python with torch (as a Deep Learning image has).

The host is a throwaway Unix user reached through a real sshd on loopback. The bootstrap
must upload this controller's wheel, its pinned wheelhouse and the project directory,
install them into a venv made from the image python (reusing its torch, installing
nothing by name: pip runs with --no-index), start the agent, which reaches the head on the
controller through the reverse SSH tunnel (forced here: the host is loopback), trains on
the default engine (torchft: its wheel shipped too, its Lighthouse on the controller's head
reached through the same tunnel) and commits checkpoints to S3 (a moto server on loopback) through s3fs, which the controller
shipped because checkpoint_dir is an s3:// URI.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO, Sshd, SshdFactory

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.usefixtures("cleanroom_account")]

SPOTCTL = [sys.executable, "-m", "spotctl.cli.app"]
USER = "spotctl-cleanroom"
HOME = Path("/home") / USER
IMAGE = Path("/opt/spotctl-cleanroom/image-py")  # the "image's" python, with torch
SYSTEM_PY = "/usr/bin/python3"


def _as_user(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", USER, "--", *argv], capture_output=True, text=True,
                          cwd="/", timeout=120)  # fmt: skip


def _ensure_user() -> None:
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", "--home-dir", str(HOME), "--shell",
                        "/bin/sh", USER], check=True)  # fmt: skip
    # not locked (sshd without PAM refuses a locked account), no password either
    subprocess.run(["usermod", "-p", "*", USER], check=True)


def link_torch(py: Path) -> None:
    """Make `py`'s site-packages see this venv's torch and what it needs, by symlinks. An
    image outlives this venv (a CI clone's, since deleted, or another checkout's): every
    link is made again, to this venv's torch."""
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())  # fmt: skip
    for old in site.iterdir():
        if old.is_symlink():
            old.unlink()
    for d in _torch_closure():
        root = Path(str(d.locate_file("")))
        for top in {f.parts[0] for f in d.files or [] if not f.as_posix().startswith("..")}:
            src, dst = root / top, site / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)


def _torch_closure() -> list[md.Distribution]:
    from packaging.requirements import Requirement

    seen: dict[str, md.Distribution] = {}
    todo = ["torch"]
    while todo:
        name = todo.pop()
        try:
            d = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        key = d.metadata["Name"].lower()
        if key in seen:
            continue
        seen[key] = d
        for raw in d.requires or []:
            r = Requirement(raw)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    for optional in ("numpy",):  # torch imports it when present
        try:
            seen[optional] = md.distribution(optional)
        except md.PackageNotFoundError:
            pass
    return list(seen.values())


def _ensure_image() -> None:
    """A venv of the system python whose site-packages holds torch and its dependencies
    (links into this project's venv), and nothing of spotctl's."""
    py = IMAGE / "bin" / "python"
    if not py.exists():
        IMAGE.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([SYSTEM_PY, "-m", "venv", str(IMAGE)], check=True)
    link_torch(py)
    os.chmod(IMAGE.parent, 0o755)


def _sshd_for_user(client_key: Path, config: str = "") -> tuple[SshdFactory, Sshd]:
    """An sshd whose files the host user can read (sshd reads authorized_keys as that
    user): the shared factory, based in a directory of ours rather than pytest's 0700 one.
    `config`: more sshd_config lines."""
    base = Path(tempfile.mkdtemp(prefix="spotctl-cleanroom-sshd-"))
    os.chmod(base, 0o711)
    factory = SshdFactory(base, client_key)
    s = factory.start(config=config)
    os.chmod(s.log.parent, 0o711)
    os.chmod(s.log.parent / "authorized_keys", 0o644)
    return factory, s


def _procs(marker: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker.encode() in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


@pytest.fixture
def host_user() -> str:
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("needs root with useradd and runuser to make a throwaway host account")
    if not Path(SYSTEM_PY).exists():
        pytest.skip(f"needs {SYSTEM_PY} for the image python")
    ver = subprocess.run([SYSTEM_PY, "-c", "import sys, ensurepip; print(sys.version_info[:2])"],
                         capture_output=True, text=True)  # fmt: skip
    if ver.returncode != 0 or ver.stdout.strip() != str(sys.version_info[:2]):
        # the image borrows this venv's torch build, which needs the same Python and venv
        pytest.skip(f"{SYSTEM_PY} is not Python {sys.version_info[0]}.{sys.version_info[1]} "
                    "with ensurepip (python3-venv)")  # fmt: skip
    _ensure_user()
    _ensure_image()
    shutil.rmtree(HOME / ".spotctl", ignore_errors=True)
    return USER


def test_bootstrap_from_uploaded_wheels_into_a_clean_account(
    host_user: str, client_key: Path, tmp_path: Path
) -> None:
    # the clean room: the image python has torch, the account has no spotctl anywhere
    img = str(IMAGE / "bin" / "python")
    assert _as_user(img, "-c", "import torch").returncode == 0
    assert _as_user(img, "-c", "import spotctl").returncode != 0
    assert _as_user(SYSTEM_PY, "-c", "import spotctl").returncode != 0
    assert not (HOME / ".spotctl").exists()

    factory, s = _sshd_for_user(client_key)
    import boto3
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    moto_url = "http://{}:{}".format(*moto.get_host_and_port())
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_url}  # fmt: skip
    s3 = boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip
    s3.create_bucket(Bucket="ckpt")
    env_toml = "{ " + ", ".join(f'{k} = "{v}"' for k, v in creds.items()) + " }"
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "templates" / "train.py", project / "real_train.py")
    (project / "steps.py").write_text('SLEEP = "0.05"\n')
    (project / "train.py").write_text(
        "import os, runpy, pathlib\n"
        "import steps  # a module of the project, uploaded with it\n"
        "os.environ.setdefault('TRAIN_STEP_SLEEP_S', steps.SLEEP)\n"
        "runpy.run_path(str(pathlib.Path(__file__).with_name('real_train.py')), "
        "run_name='__main__')\n"
    )
    (project / "data").mkdir()
    (project / "data" / "huge.bin").write_bytes(b"\0" * 4096)
    (project / ".spotctlignore").write_text("data/\n")
    (project / "spotctl.toml").write_text(
        'name = "clean"\nprovider = "ssh"\ngpus = "1"\n\n'
        '[train]\nscript = "train.py"\ncheckpoint_every = 5\ncheckpoint_dir = "s3://ckpt/clean"\n'
        f"env = {env_toml}\n\n"
        f'[ssh]\nbase_python = "{img}"\ndedicated_hosts = true\n\n'
        f'[[ssh.hosts]]\naddress = "127.0.0.1"\nport = {s.port}\nuser = "{USER}"\n'
        f'key = "{client_key}"\n'
    )
    env = dict(os.environ, SPOTCTL_HOME=str(tmp_path / "home"), NO_COLOR="1",
               SPOTCTL_SSH_TUNNEL="always")  # fmt: skip
    env.pop("SPOTCTL_SSH_REMOTE_ROOT", None)
    node = f"ssh-127-0-0-1-{s.port}"
    ndir = HOME / ".spotctl" / "clean" / node

    def cli(
        *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([*SPOTCTL, *args], cwd=project, env=env, text=True,
                           capture_output=True, timeout=timeout)  # fmt: skip
        if check and p.returncode != 0:
            raise AssertionError(f"spotctl {' '.join(args)} exited {p.returncode}:\n"
                                 f"{p.stdout}\n{p.stderr}\n{debug()}")  # fmt: skip
        return p

    def debug() -> str:
        logs = [ndir / "bootstrap.log", ndir / "agent.log", ndir / "work" / "torchrun.log"]
        logs += sorted((tmp_path / "home").glob("clusters/clean/tunnels/*.log"))
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in logs if p.exists())  # fmt: skip

    def status() -> dict[str, Any]:
        return dict(json.loads(cli("status", "--name", "clean", "--json").stdout))

    try:
        cli("up", "--wait", "300")
        deadline = time.monotonic() + 240
        st = status()
        while not ((st.get("step") or 0) >= 12):
            assert time.monotonic() < deadline, f"no progress: {json.dumps(st)[:1500]}\n{debug()}"
            time.sleep(1)
            st = status()

        # installed from the uploaded files, into a venv of the image python
        venvs = [p for p in (HOME / ".spotctl" / "venvs").iterdir() if p.is_dir()]
        assert len(venvs) == 1, venvs
        vpy = str(venvs[0] / "bin" / "python")
        r = _as_user(vpy, "-c", "import spotctl, torch, torchft; print(spotctl.__file__); "
                     "print(torch.__file__); print(torchft.__file__)")  # fmt: skip
        assert r.returncode == 0, r.stderr
        spotctl_file, torch_file, ft_file = r.stdout.split()
        assert spotctl_file.startswith(str(venvs[0])), spotctl_file  # our wheel, in the venv
        assert not torch_file.startswith(str(venvs[0])), torch_file  # the image's torch
        # the default engine's torchft (a compiled wheel), uploaded and installed there too
        assert ft_file.startswith(str(venvs[0])), ft_file
        assert (ndir / "pkg" / "requirements.txt").exists()
        pins = (ndir / "pkg" / "requirements.txt").read_text().split()
        assert pins and all("==" in p for p in pins)
        log = (ndir / "bootstrap.log").read_text() if (ndir / "bootstrap.log").exists() else ""
        assert "Downloading" not in log, log[-2000:]  # nothing came from an index
        # the project directory, minus what .spotctlignore excludes
        assert (ndir / "project" / "steps.py").exists()
        assert not (ndir / "project" / "data").exists()
        # the agent runs as the host user, in the venv, and talks to the head through the
        # reverse tunnel on the host's loopback (never the controller's head port)
        cfg = json.loads(_as_user("cat", str(ndir / "agent.json")).stdout)
        assert cfg["python"] == vpy
        assert cfg["engine"] == "torchft" and cfg["lighthouse"].startswith("http://127.0.0.1:")
        head = json.loads(
            (tmp_path / "home" / "clusters" / "clean" / "tunnels" / f"{node}.json").read_text()
        )
        assert cfg["head_url"] == f"http://127.0.0.1:{head['api']}"
        assert cfg["store_port"] == head["store"]
        # committed checkpoints in S3, through the s3fs the controller shipped
        assert cfg["checkpoint_dir"] == "s3://ckpt/clean"
        assert any(p.startswith("s3fs==") for p in pins)
        assert "torchft==0.2.0" in pins, pins
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="ckpt").get("Contents", [])]
        assert any(k.startswith("clean/") and k.endswith("COMMIT") for k in keys), (
            f"no committed checkpoint in s3://ckpt: {keys[:20]}\n{debug()}"
        )

        # `up` again: nothing reinstalled, the running agent left alone
        stamp = venvs[0] / ".spotctl-package"
        before = (stamp.stat().st_mtime_ns, (ndir / "agent.pid").read_text())
        cli("up", "--wait", "120")
        assert (stamp.stat().st_mtime_ns, (ndir / "agent.pid").read_text()) == before
        cli("down", "--name", "clean", "--yes")
        deadline = time.monotonic() + 60
        while _procs(str(ndir)):
            assert time.monotonic() < deadline, f"left running: {_procs(str(ndir))}"
            time.sleep(0.5)
        assert not (ndir / "token").exists()
        assert not _procs(f"tunnels/{node}.spec.json"), "reverse tunnel left running"
    finally:
        if (tmp_path / "home" / "state.db").exists():
            cli("down", "--name", "clean", "--yes", check=False)
        for pid in _procs(str(HOME / ".spotctl")) + _procs(str(tmp_path / "home")):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        factory.stop_all()
        shutil.rmtree(factory.base, ignore_errors=True)
        moto.stop()
