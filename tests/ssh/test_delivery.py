"""What the controller ships to nodes (spotctl.remote.package), the ssh provider's storage
rule, and its reverse tunnel to the head (a real sshd on loopback, the real head)."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request
import zipfile
from pathlib import Path

import pytest

from spotctl.errors import BootstrapError, SpecError
from spotctl.providers.base import ProviderContext
from spotctl.providers.ssh.provider import SshProvider
from spotctl.remote import revtunnel
from spotctl.remote.package import node_package, project_files
from spotctl.spec import ClusterSpec
from spotctl.state import Store

from .conftest import Head, SshdFactory


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


PROJECT = {
    "train.py": "print('hi')\n",
    "model/net.py": "X = 1\n",
    "data/big.bin": "x" * 100,
    "notes.log": "log\n",
    "keep/important.log": "kept\n",
    "ckpt/step-1/x": "y",
    ".venv/lib/x.py": "no\n",
    "model/__pycache__/net.cpython-311.pyc": "no",
    ".gitignore": "*.log\n!keep/important.log\ndata/\n",
    ".spotctlignore": "ckpt/\n",
}
EXPECTED = {"train.py", "model/net.py", "keep/important.log", ".gitignore", ".spotctlignore"}


def test_project_honours_gitignore_and_spotctlignore(tmp_path: Path) -> None:
    _tree(tmp_path, PROJECT)
    p = project_files(tmp_path)
    assert set(p.files) == EXPECTED
    assert p.files["model/net.py"] == b"X = 1\n"
    assert f"{len(EXPECTED)} files" in p.summary()


def test_project_in_a_git_work_tree_uses_git(tmp_path: Path) -> None:
    _tree(tmp_path, PROJECT)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert set(project_files(tmp_path).files) == EXPECTED


def test_project_too_big_names_the_biggest_file(tmp_path: Path) -> None:
    _tree(tmp_path, {"train.py": "x", "weights.pt": "w" * 5000})
    with pytest.raises(
        BootstrapError, match=r"weights\.pt .*\.spotctlignore|\.spotctlignore.*weights\.pt"
    ):
        project_files(tmp_path, max_bytes=1000)


@pytest.mark.slow  # over 4 s: out of the fast set
def test_node_package_is_pinned_and_self_contained(tmp_path: Path) -> None:
    pkg = node_package(tmp_path / "cache")
    pins = [ln for ln in pkg.requirements.splitlines() if ln]
    names = {ln.split("==")[0].lower().replace("_", "-") for ln in pins}
    assert all("==" in ln for ln in pins)
    assert {"typer", "rich", "pydantic", "fabric", "platformdirs"} <= names
    assert "torch" not in names and "spotctl" not in names
    # every pinned dependency and spotctl itself are in the wheelhouse
    wheel_names = {w.split("-")[0].lower().replace("_", "-") for w in pkg.wheels}
    assert names | {"spotctl"} <= wheel_names
    own = pkg.wheels[pkg.spotctl_wheel]
    (tmp_path / pkg.spotctl_wheel).write_bytes(own)
    with zipfile.ZipFile(tmp_path / pkg.spotctl_wheel) as z:
        assert "spotctl/remote/package.py" in z.namelist()
        assert "spotctl/templates/bootstrap.sh" in z.namelist()  # self-contained
    # cached: a second call (new process memo aside) reuses the built files
    assert node_package(tmp_path / "cache").key == pkg.key
    assert "pkg/key" in pkg.files()


def test_an_aws_head_that_replaces_nodes_gets_boto3_and_can_hand_the_package_on(
    tmp_path: Path,
) -> None:  # fmt: skip
    """The AWS head runs the reconcile loop (boto3: the `aws` extra) and installs
    replacement nodes from the package it was given (NodePackage.from_dir)."""
    from spotctl.remote.bootstrap import package_extras
    from spotctl.remote.package import NodePackage

    aws = ClusterSpec.model_validate({"provider": "aws", "train": {"engine": "torchrun"}})
    off = ClusterSpec.model_validate({"provider": "aws", "train": {"engine": "torchrun"},
                                      "rebalance": {"on_head": False}})  # fmt: skip
    assert package_extras(aws) == ("aws",) and package_extras(off) == ()
    pkg = node_package(tmp_path / "cache", extras=package_extras(aws))
    names = {ln.split("==")[0].lower() for ln in pkg.requirements.splitlines() if ln}
    assert {"boto3", "botocore"} <= names
    d = tmp_path / "head"
    for rel, content in pkg.files("pkg").items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(content)
    again = NodePackage.from_dir(d / "pkg")
    assert again.files("pkg") == pkg.files("pkg") and again.key == pkg.key


def _provider(tmp_path: Path, ssh: dict[str, object], train: dict[str, object]) -> SshProvider:
    spec = ClusterSpec.model_validate({"name": "c1", "provider": "ssh", "ssh": ssh, "train": train})
    store = Store(tmp_path / "home")
    return SshProvider(ProviderContext("c1", spec, store.cluster_dir("c1")))


def test_ssh_checkpoints_must_be_shared(tmp_path: Path) -> None:
    remote = {"hosts": [{"address": "10.0.0.5"}]}
    with pytest.raises(SpecError, match="checkpoint_dir.*object-store URI"):
        _provider(tmp_path, remote, {}).checkpoint_dir()
    with pytest.raises(SpecError, match="shared_mount"):
        _provider(
            tmp_path, remote, {"checkpoint_dir": "/data/c", "shared_mount": "/mnt/s"}
        ).checkpoint_dir()
    assert (
        _provider(tmp_path, remote, {"checkpoint_dir": "s3://b/p"}).checkpoint_dir() == "s3://b/p"
    )
    shared = _provider(tmp_path, remote, {"shared_mount": "/mnt/s/"})
    assert shared.checkpoint_dir() == "/mnt/s/c1/checkpoints"
    inside = _provider(tmp_path, remote, {"checkpoint_dir": "/mnt/s/x", "shared_mount": "/mnt/s"})
    assert inside.checkpoint_dir() == "/mnt/s/x"
    # every host is this machine: the controller's directory is shared by construction
    local = _provider(tmp_path, {"hosts": [{"address": "127.0.0.1"}]}, {})
    assert local.checkpoint_dir().endswith("checkpoints")


@pytest.mark.ssh
@pytest.mark.slow  # over 4 s: out of the fast set
def test_reverse_tunnel_reaches_the_head_on_the_hosts_loopback(
    sshd_factory: SshdFactory, client_key: Path, head: Head, tmp_path: Path
) -> None:
    s = sshd_factory.start()
    api = int(head.url.rsplit(":", 1)[1])
    spec = revtunnel.TunnelSpec(
        name="n1", address="127.0.0.1", port=s.port, user="root", key_file=str(client_key),
        known_hosts=str(tmp_path / "known_hosts"), local_api=api, local_store=head.store_port,
    )  # fmt: skip
    base = tmp_path / "tunnels"
    rapi, rstore = revtunnel.ensure(base, spec)
    try:
        assert rapi not in (0, api) and rstore not in (0, head.store_port)
        # sshd binds the forwards to the host's loopback (GatewayPorts no)
        req = urllib.request.Request(
            f"http://127.0.0.1:{rapi}/api/health", headers={"Authorization": f"Bearer {head.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.load(r)["ok"]
        with socket.create_connection(("127.0.0.1", rstore), timeout=5):
            pass
        # reused while alive, same ports
        assert revtunnel.ensure(base, spec) == (rapi, rstore)
    finally:
        revtunnel.stop(base, "n1")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", rapi), timeout=2).close()


@pytest.mark.ssh
def test_reverse_tunnel_refuses_a_changed_host_key(
    sshd_factory: SshdFactory, client_key: Path, tmp_path: Path
) -> None:
    s = sshd_factory.start()
    kh = tmp_path / "known_hosts"
    kh.write_text(
        f"[127.0.0.1]:{s.port} ssh-ed25519 "
        "AAAAC3NzaC1lZDI1NTE5AAAAIHk0dXBvYmNkZWZnaGlqa2xtbm9wcXJzdHV2d3h5ejAx\n"
    )
    spec = revtunnel.TunnelSpec("n2", "127.0.0.1", s.port, "root", str(client_key), str(kh), 1, 2)
    with pytest.raises(BootstrapError, match="reverse tunnel.*did not come up"):
        revtunnel.ensure(tmp_path / "t", spec, timeout_s=30)


def test_up_progress_shows_what_was_uploaded() -> None:
    from spotctl.cli import up_progress

    p = up_progress.reconcile_phase("bootstrapped n1 in 3.0s, sent 12.1 MiB (1/2, ok)")
    assert p["sent"] == "12.1 MiB" and p["done"] == 1 and p["ok"]
    assert up_progress.describe(p) == "bootstrapped n1 in 3.0s, sent 12.1 MiB (1/2)"


def test_training_listeners_bind_loopback_on_a_single_host(tmp_path: Path) -> None:
    """One host: its workers' stores, gloo and torchft's Manager bind its loopback, out of
    its network's reach. Several (on a network the spec says is trusted): the host's
    address, where the other hosts reach them."""
    from spotctl.providers.base import HeadInfo, Instance

    head = HeadInfo(url="http://127.0.0.1:7470", store_host="127.0.0.1", store_port=29400)

    def vm(address: str) -> Instance:
        return Instance(id="ssh-x", cluster="c1", role="worker", zone="ssh-x",
                        instance_type="ssh", gpus=1, state="running", request_id="",
                        address=address)  # fmt: skip

    train = {"engine": "torchrun", "checkpoint_dir": "s3://b/c"}
    one = _provider(tmp_path, {"hosts": [{"address": "10.0.0.11"}]}, train)
    assert one.agent_config(vm("10.0.0.11"), head).local_addr == "127.0.0.1"
    two = _provider(tmp_path, {"hosts": [{"address": "10.0.0.11"}, {"address": "10.0.0.12"}],
                               "trusted_network": True}, train)
    assert two.agent_config(vm("10.0.0.12"), head).local_addr == "10.0.0.12"
