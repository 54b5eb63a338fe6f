"""What the controller uploads to every node is a project, never the user's secrets: a
train.py in the home directory (which would ship ~/.ssh, ~/.aws, gcloud's credentials and
spotctl's cluster secret) is refused with one line, as are /, system directories, a
project holding spotctl's state, and one holding credentials it does not ignore."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotctl.errors import SpotctlError
from spotctl.remote.package import project_files


def _project(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.py").write_text("print('hi')\n")
    return d


def test_a_home_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     spotctl_home: Path) -> None:
    home = _project(tmp_path / "alice")
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_ed25519").write_text("PRIVATE KEY")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(SpotctlError, match="is your home directory") as e:
        project_files(home)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("where", ["/", "/etc"])
def test_root_and_system_directories_are_refused(where: str, spotctl_home: Path) -> None:
    with pytest.raises(SpotctlError, match="file system's root|system directory"):
        project_files(Path(where))


@pytest.mark.parametrize("cred", [".aws/credentials", ".config/gcloud/credentials.db",
                                  "sub/.ssh/id_rsa", ".netrc"])
def test_credentials_in_a_project_are_refused_unless_ignored(
        cred: str, tmp_path: Path, spotctl_home: Path) -> None:
    proj = _project(tmp_path / "proj")
    f = proj / cred
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("secret")
    first = cred.split("/")[0] if not cred.startswith(".config") else ".config/gcloud"
    if cred.startswith("sub/"):
        first = "sub/.ssh"
    with pytest.raises(SpotctlError, match=f"holds credentials \\({first}\\)"):
        project_files(proj)
    # the user says it stays here: then it is not shipped, and the rest is
    (proj / ".spotctlignore").write_text(first + "\n")
    files = project_files(proj).files
    assert "train.py" in files and not any("secret" == v.decode() for v in files.values())


def test_a_project_holding_spotctls_state_is_refused(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    proj = _project(tmp_path / "proj")
    monkeypatch.setenv("SPOTCTL_HOME", str(proj / "state"))
    with pytest.raises(SpotctlError, match="holds spotctl's state"):
        project_files(proj)


def test_an_ordinary_project_ships(tmp_path: Path, spotctl_home: Path) -> None:
    proj = _project(tmp_path / "proj")
    (proj / "model.py").write_text("x = 1\n")
    assert sorted(project_files(proj).files) == ["model.py", "train.py"]
