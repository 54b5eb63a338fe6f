"""Root never loads what an unprivileged process can write: the torchrun engine's
rendezvous state lives in the head's store as a pickle, and anyone who reaches the store
(any cluster member, a training script included) can write it. An unauthenticated client
writes a payload there; the root agent's rendezvous leave (what it does on every notice)
must not run it as root. It goes through the leave server, which runs as the training
user, the user torchrun itself runs as: so the payload runs, at worst, with the training
script's own rights."""

from __future__ import annotations

import base64
import os
import pickle
import pwd
from datetime import timedelta
from pathlib import Path

import pytest

from spotctl.agent.config import AgentConfig
from spotctl.head.auth import node_token
from tests.conftest import Head

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="the leave as the training user needs a root agent"),
]
torch = pytest.importorskip("torch")

WORKER_USER = "nobody"


class Payload:
    """Unpickling this appends the unpickling process' uid to `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"id -u >> {self.path}",))


def test_a_pickle_written_to_the_store_never_runs_as_root(
        base: Path, tmp_path: Path, interpreter_reachable: None) -> None:
    from spotctl.agent.supervisor import Agent

    nobody = pwd.getpwnam(WORKER_USER)
    head = Head(tmp_path)
    agent = None
    try:
        node = base / "node"
        node.mkdir(mode=0o711)
        tok = node / "token"
        fd = os.open(tok, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, (node_token(head.token, "n1") + "\n").encode())
        os.close(fd)
        project = base / "project"
        project.mkdir(mode=0o755)
        os.chmod(project, 0o755)
        script = project / "train.py"
        script.write_text("pass\n")
        os.chmod(script, 0o644)
        cfg = AgentConfig(
            cluster="iso", node_id="n1", head_url=head.url, store_host="127.0.0.1",
            store_port=head.store_port, token_file=str(tok), workdir=str(node / "work"),
            script=str(script), run_as=WORKER_USER, engine="torchrun")
        agent = Agent(cfg)
        assert agent.worker is not None and agent.worker.uid == nobody.pw_uid
        # a leave from an untouched rendezvous: the leave server answers (nothing listed)
        assert agent._leave_rendezvous(pid=424242) is True
        assert agent._leaver is not None
        assert os.stat(f"/proc/{agent._leaver.pid}").st_uid == nobody.pw_uid

        # the attacker: no token, only the store's address
        pwned = base / "pwned"
        pwned.touch()
        os.chmod(pwned, 0o666)
        store = torch.distributed.TCPStore("127.0.0.1", head.store_port, is_master=False,
                                           timeout=timedelta(seconds=10), use_libuv=True)
        store.set("torch.rendezvous.iso",
                  base64.b64encode(pickle.dumps(Payload(str(pwned)))).decode())
        # what the agent does after stopping its torchrun on a notice
        with pytest.raises(Exception):  # noqa: B017 - the payload broke the state it read
            agent._leave_rendezvous(pid=424242)
        uids = {int(x) for x in pwned.read_text().split()}
        # the payload ran, in the leave server: as the training user, never as root
        assert uids == {nobody.pw_uid}, uids
    finally:
        if agent is not None and agent._leaver is not None:
            agent._leaver.kill()
            agent._leaver.wait()
        head.close()
