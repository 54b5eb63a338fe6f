"""Issue 60, finding 5: an ssh cluster's listeners sit on loopback, unauthenticated.

The head's store and Lighthouse listen on the controller's 127.0.0.1 and, through a
reverse SSH forward, on each host's; each host's worker store, gloo and torchft Manager on
its loopback. Any other user of those machines reaches them (a rendezvous pickle in the
head's store runs as the training user on every host). Until spotctl can put them out of
a neighbour's reach on machines it does not own, `up` refuses such a cluster unless the
spec says no one else uses those machines, before it contacts any host or starts a head.
On the code before this change the same `up` connected to the host (the listener below
saw a connection) and started the head on loopback."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from tests.conftest import CliProject

pytestmark = pytest.mark.ssh

SPEC = (
    'name = "shared"\nprovider = "ssh"\ngpus = "1"\n\n'
    '[train]\nscript = "train.py"\ncheckpoint_every = 5\n\n'
    "{ssh}"
    '[[ssh.hosts]]\naddress = "127.0.0.1"\nport = {port}\n'
)


def test_up_refuses_an_ssh_cluster_on_hosts_not_declared_dedicated(tmp_path: Path) -> None:
    # stands where the host's sshd would: records whether `up` ever came
    lsn = socket.create_server(("127.0.0.1", 0))
    lsn.settimeout(0.2)
    came: list[bool] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                c, _ = lsn.accept()
            except OSError:
                continue
            came.append(True)
            c.close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    proj = CliProject(tmp_path, "shared")
    spec = proj.project / "spotctl.toml"
    spec.write_text(SPEC.format(ssh="", port=lsn.getsockname()[1]))
    try:
        p = proj.cli("up", "--wait", "5", check=False, timeout=120)
    finally:
        stop.set()
        t.join()
        lsn.close()
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert len(err) == 1 and "[ssh] dedicated_hosts = true" in err[0], p.stderr
    assert "any other user of those machines can reach them" in err[0], err
    assert not came, "up contacted the host before refusing"
    # nothing was started or recorded: no cluster, no head
    from spotctl.state import Store

    st = Store(proj.home)
    assert [c.name for c in st.clusters()] == []
    st.close()
    assert not list(proj.home.glob("**/head.json"))
    # the same spec saying so gets past this check
    from spotctl.control.reconcile import check_shared_hosts
    from spotctl.spec import load_spec

    spec.write_text(SPEC.format(ssh="[ssh]\ndedicated_hosts = true\n\n", port=1))
    check_shared_hosts(load_spec(spec, check_script=False))
