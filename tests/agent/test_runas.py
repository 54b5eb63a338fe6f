"""Who training workers may run as (`[train] run_as`, spotctl.agent.runas): a bad user is
refused with one clear line, at the spec on the controller (root, and names that are no
user name) and by the agent on the node (root, a user that does not exist, any uid-0
alias), never accepted and run with whatever privileges that name turns out to have."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spotctl.agent import runas
from spotctl.errors import SpecError
from spotctl.spec import load_spec

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the agent switches users only as root")


@pytest.mark.parametrize("name", ["Root", "bad user", "a;reboot", "../etc/passwd", "-x", "0",
                                  "x" * 33, "a\nb", "tr\u00e4in"])
def test_the_spec_refuses_a_name_that_is_no_user_name(name: str) -> None:
    with pytest.raises(SpecError) as e:
        load_spec(overrides={"name": "c", "train.run_as": name}, check_script=False)
    msg = str(e.value)
    assert "train.run_as" in msg and "\n" not in msg, msg
    if name.isprintable():
        assert f"{name[:40]!r} is not a user name" in msg, msg


def test_the_spec_refuses_root() -> None:
    with pytest.raises(SpecError, match=r"train\.run_as: 'root' would let the workers read "
                                        "the node's credential; name an unprivileged user"):
        load_spec(overrides={"name": "c", "train.run_as": "root"}, check_script=False)


def test_the_spec_takes_an_ordinary_user_or_none() -> None:
    for name in ("spotctl-train", "_svc", "trainer1", ""):
        s = load_spec(overrides={"name": "c", "train.run_as": name}, check_script=False)
        assert s.train.run_as == name


@as_root
def test_the_agent_refuses_root() -> None:
    with pytest.raises(ValueError, match="run_as: 'root' is root; name an unprivileged user"):
        runas.resolve("root")


@as_root
@pytest.mark.parametrize("name", ["spotctl-no-such-user-7f3a", "bad user", "../etc/passwd"])
def test_the_agent_refuses_a_user_that_does_not_exist(name: str) -> None:
    with pytest.raises(ValueError, match=f"run_as: there is no user {name!r} on this node"):
        runas.resolve(name)


@as_root
def test_the_agent_switches_to_an_unprivileged_user() -> None:
    u = runas.resolve("nobody")
    assert u is not None and u.name == "nobody" and u.uid == 65534
    assert u.uid != 0 and u.gid != 0 and 0 not in u.groups
    assert u.popen_kwargs() == {"user": u.uid, "group": u.gid, "extra_groups": list(u.groups)}


@as_root
def test_the_agent_refuses_a_uid_0_alias(tmp_path: Path) -> None:
    """A second name for uid 0 (`toor`) is root too. The alias exists only inside a mount
    namespace of this test's own, where a copy of /etc/passwd with it is bound over the
    real one; the agent's lookup there is the real one (NSS reading /etc/passwd)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    passwd = tmp_path / "passwd"
    passwd.write_text(Path("/etc/passwd").read_text() + "toor:x:0:0:alias:/root:/bin/sh\n")
    code = textwrap.dedent("""
        import pwd, sys
        from spotctl.agent import runas
        assert pwd.getpwnam("toor").pw_uid == 0  # the alias is there
        try:
            runas.resolve("toor")
        except ValueError as e:
            print(e)
            sys.exit(3)
        print("accepted")
    """)
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.decode().strip()}")
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount --bind "$1" /etc/passwd && exec "$2" -c "$3"', "sh", str(passwd),
         sys.executable, code],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(runas.__file__).parents[2])},
    )
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert r.stdout.strip() == "run_as: 'toor' is root; name an unprivileged user"
    # and the real /etc/passwd never had it
    with pytest.raises(KeyError):
        __import__("pwd").getpwnam("toor")
