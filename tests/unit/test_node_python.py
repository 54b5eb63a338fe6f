"""Which node interpreter a venv is made from (spotctl.remote.interp) and whether the
shipped wheels fit a node's Python (NodePackage.fit), on wheels built here with the
metadata fields that decide it (Requires-Python, file-name tags)."""

from __future__ import annotations

import io
import zipfile

import pytest

from spotctl.errors import BootstrapError
from spotctl.remote.interp import NodePython, choose, parse_probe, probe_command
from spotctl.remote.package import NodePackage


def _wheel(name: str, version: str, tag: str, requires_python: str = "") -> tuple[str, bytes]:
    buf = io.BytesIO()
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    if requires_python:
        meta += f"Requires-Python: {requires_python}\n"
    meta += "\nA description that mentions Requires-Python: >=9.9 (not a header)\n"
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return f"{name}-{version}-{tag}.whl", buf.getvalue()


def _package(*wheels: tuple[str, bytes]) -> NodePackage:
    return NodePackage(dict(wheels), "", wheels[0][0], "k")


PKG = _package(
    _wheel("spotctl", "0.1.0", "py3-none-any", ">=3.10"),
    _wheel("typer", "0.29.2", "py3-none-any", ">=3.11"),
    _wheel("platformdirs", "4.14.9", "py3-none-any", ">=3.11"),
    _wheel("pydantic_core", "2.50.5", "cp311-cp311-manylinux_2_17_x86_64", ">=3.10"),
    _wheel("cryptography", "50.0.2", "cp311-abi3-manylinux_2_28_x86_64",
           ">=3.9, !=3.9.0, !=3.9.1"),
)


def _py(path: str, minor: int, torch: str = "", ensurepip: bool = True,
        machine: str = "x86_64") -> NodePython:
    return NodePython(path, (3, minor, 4), ensurepip, True, torch, machine)


def test_requires_python_decides_what_a_node_cannot_install() -> None:
    hard, soft = PKG.fit((3, 10, 12), "x86_64")
    assert hard == ("the shipped pins platformdirs==4.14.9, typer==0.29.2 require "
                    "Python >=3.11")
    hard, soft = PKG.fit((3, 11, 7), "x86_64")
    assert (hard, soft) == ("", [])
    # 3.12: every pin allows it; the cp311 build must come from the node's index
    hard, soft = PKG.fit((3, 12, 1), "x86_64")
    assert hard == "" and soft == ["pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl"]
    # another machine: no compiled wheel fits
    assert len(PKG.fit((3, 11, 7), "aarch64")[1]) == 2


def test_the_torch_environment_wins_over_the_base_python() -> None:
    cands = ["/opt/pytorch/bin/python3", "python3"]
    found = [_py("/opt/pytorch/bin/python3", 11, torch="2.9.1+cu128", ensurepip=False),
             _py("python3", 11)]
    assert choose(found, cands, PKG, "n1").path == "/opt/pytorch/bin/python3"
    # an old torch is not reused (torchft cannot run on 2.7): the base python gets the
    # pinned torch
    for old in ("2.7.1+cu128", "2.8.0", "1.13.1"):
        found[0] = _py("/opt/pytorch/bin/python3", 11, torch=old)
        assert choose(found, cands, PKG, "n1").path == "python3", old


def test_a_python_the_pins_exclude_is_passed_over_for_one_they_fit() -> None:
    cands = ["/opt/conda/bin/python3", "python3"]
    found = [_py("/opt/conda/bin/python3", 10), _py("python3", 11)]
    assert choose(found, cands, PKG, "n1").path == "python3"
    # among fitting ones without torch: the one that needs no package index first
    found = [_py("/opt/conda/bin/python3", 12), _py("python3", 11)]
    assert choose(found, cands, PKG, "n1").path == "python3"
    # a torch environment still wins: it saves the multi-GB download
    found = [_py("/opt/conda/bin/python3", 10, torch="2.9.0"), _py("python3", 11)]
    assert choose(found, cands, PKG, "n1").path == "/opt/conda/bin/python3"


def test_a_python_only_some_pins_exclude_takes_older_releases_of_those() -> None:
    """Ubuntu 22.04's 3.10 against a 3.11 controller: spotctl itself allows it, typer and
    platformdirs do not. The node is used, marked to take older releases from its index."""
    chosen = choose([_py("python3", 10)], ["python3"], PKG, "n1")
    assert chosen.path == "python3" and chosen.older
    assert not choose([_py("python3", 11)], ["python3"], PKG, "n1").older
    assert PKG.own_fit((3, 10, 12)) == "" and PKG.own_fit((3, 9, 18)) == (
        "spotctl requires Python >=3.10")


def test_no_usable_interpreter_is_one_line_naming_each_python() -> None:
    with pytest.raises(BootstrapError) as e:
        choose([_py("python3", 9), NodePython("/usr/bin/python3.12", (3, 12, 3), False, False,
                                              "", "x86_64")],
               ["python3", "/usr/bin/python3.12"], PKG, "n1 (u@h:22)")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("n1 (u@h:22): no interpreter on the node can run spotctl")
    assert "python3 is Python 3.9; spotctl requires Python >=3.10" in msg
    assert "/usr/bin/python3.12 (Python 3.12) has no venv module" in msg
    with pytest.raises(BootstrapError, match="no Python interpreter on the node"):
        choose([], ["python3"], PKG, "n1")


def test_the_probe_runs_each_candidate_and_reads_its_answer() -> None:
    import subprocess
    import sys

    cmd = probe_command([sys.executable, "/nonexistent/python3"])
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60).stdout
    (me,) = parse_probe(out + "noise\nspotctl-python {not json}\n")
    assert me.path == sys.executable and me.version[:2] == sys.version_info[:2]
    assert me.torch and me.torch_ok()  # this venv's torch, read from its metadata



def test_the_probe_asks_the_python3_a_login_shell_finds(tmp_path) -> None:
    """An image whose profile puts its torch environment on PATH (where a user's SSH
    session finds it): the probe asks that python3 by its absolute path, which no
    candidate names; a profile that prints is no path. Without `login`, it is not asked."""
    import subprocess
    import sys

    env_bin = tmp_path / "image-env" / "bin"
    env_bin.mkdir(parents=True)
    (env_bin / "python3").symlink_to(sys.executable)
    (tmp_path / ".profile").write_text(f'echo "Welcome to the image"\nPATH="{env_bin}:$PATH"\n')
    (tmp_path / ".bash_profile").write_text(". ~/.profile\n")
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    found = parse_probe(subprocess.run(["sh", "-c", probe_command(["/nonexistent/python3"],
                                                                  login=True)],
                                       capture_output=True, text=True, env=env,
                                       timeout=60).stdout)  # fmt: skip
    assert [p.path for p in found] == [str(env_bin / "python3")], found
    assert found[0].version[:2] == sys.version_info[:2]
    none = subprocess.run(["sh", "-c", probe_command(["/nonexistent/python3"])],
                          capture_output=True, text=True, env=env, timeout=60).stdout
    assert parse_probe(none) == []


def test_the_login_shells_python_counts_only_for_its_torch() -> None:
    cands = ["/opt/pytorch/bin/python3", "python3"]
    login = "/opt/image/venv/bin/python3"  # no candidate names it
    found = [_py("python3", 10), _py(login, 11)]
    assert choose(found, cands, PKG, "n1").path == "python3"  # no torch: not wanted
    found = [_py("python3", 11), _py(login, 11, torch="2.9.1+cu129", ensurepip=False)]
    assert choose(found, cands, PKG, "n1").path == login  # the image's torch


def test_candidates_are_the_torch_envs_then_the_base_python() -> None:
    from spotctl.remote.interp import candidates_for

    assert candidates_for(["/opt/pytorch/bin/python3", "python3"], "python3") == [
        "/opt/pytorch/bin/python3", "python3"]


def test_an_older_python_gets_the_controllers_versions_as_upper_bounds(tmp_path) -> None:
    """What a node older than some pins allow installs from: spotctl's wheel, the top-level
    names of the shipped extras (not torch: installed apart, pinned) and the checkpoint
    backends; every shipped dependency at the controller's exact version, except one whose
    version drops a Python that spotctl still runs on: that one bounded by it."""
    import importlib.metadata as md

    from spotctl.remote.package import _drops_python, node_package

    pkg = node_package(tmp_path, extras=("ft",), also=("s3fs",))
    assert pkg.older_requirements.split() == ["torchft", "hpack", "s3fs"]
    lines = pkg.older_constraints.split()
    assert {ln.replace("<=", "==") for ln in lines} == set(pkg.requirements.split())
    relaxed = {ln.split("<=")[0] for ln in lines if "<=" in ln}
    assert f"typer<={md.version('typer')}" in lines  # 0.29 needs 3.11, spotctl runs on 3.10
    assert f"torchft=={md.version('torchft')}" in lines  # spotctl drives its internals
    for name in relaxed:
        wheel = next(w for w in pkg.wheels if w.lower().startswith(
            name.lower().replace("-", "_") + "-"))
        assert _drops_python(pkg.requires_python(wheel), ">=3.10"), name
    assert not any(ln.startswith("torch") and ln[5] in "=<" for ln in lines)
    assert _drops_python(">=3.11", ">=3.10") and not _drops_python(">=3.9", ">=3.10")
    assert not _drops_python("", ">=3.10")
    files = pkg.files()
    assert files["pkg/constraints.txt"] == pkg.older_constraints.encode()
    assert files["pkg/requirements-older.txt"] == pkg.older_requirements.encode()


@pytest.mark.parametrize(("name", "says"), [
    ("pytorch-2-9-cu129-ubuntu-2404-nvidia-580-v20251105", ""),
    ("pytorch-2-10-cu130-ubuntu-2404-nvidia-580-v20260301", ""),
    ("Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.9 (Ubuntu 24.04) 20260301", ""),
    ("ubuntu-2404-noble-amd64-v20260101", ""),
    ("Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.7 (Ubuntu 22.04) 20250602",
     "its PyTorch 2.7 is older than 2.9: each node downloads torch==2.13.0 instead"),
    ("/aws/service/deeplearning/ami/x86_64/oss-nvidia-driver-gpu-pytorch-2.7-ubuntu-22.04/"
     "latest/ami-id", "its PyTorch 2.7 is older than 2.9"),
    ("pytorch-2-8-cu128-ubuntu-2204-nvidia-580-v20250901", "its PyTorch 2.8 is older"),
])
def test_check_reads_the_torch_an_image_name_names(name: str, says: str) -> None:
    from spotctl.remote.package import image_torch

    got = image_torch(name)
    assert (got.startswith(says) if says else got == ""), got


def test_an_image_whose_torch_and_driver_are_both_too_old_blocks() -> None:
    from spotctl.errors import SpecError
    from spotctl.remote.package import image_torch

    with pytest.raises(SpecError) as e:
        image_torch("pytorch-2-7-cu128-ubuntu-2204-nvidia-570-v20250601")
    assert str(e.value) == (
        "pytorch-2-7-cu128-ubuntu-2204-nvidia-570-v20250601: its PyTorch 2.7 is older than "
        "2.9, so each node would install torch==2.13.0, which needs NVIDIA driver 580 or "
        "newer, and the image's is 570: pick an image with PyTorch 2.9 or newer")
