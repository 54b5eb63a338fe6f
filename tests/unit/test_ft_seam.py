"""The torchft engine's seam: `[train] engine` in the spec, the agent's per-node replica
group command and environment, and the head's Lighthouse (bound like the store: a client
from another loopback address is refused)."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
from pathlib import Path

import pytest

from spotctl.agent.config import AgentConfig
from spotctl.agent.supervisor import torchrun_command
from spotctl.errors import SpecError
from spotctl.spec import load_spec

HAVE_FT = importlib.util.find_spec("torchft") is not None


def _spec(tmp: Path, body: str) -> Path:
    (tmp / "train.py").write_text("print('hi')\n")
    p = tmp / "spotctl.toml"
    p.write_text(body)
    return p


def test_engine_defaults_to_torchft_and_takes_torchrun(tmp_path: Path) -> None:
    assert load_spec(_spec(tmp_path, 'name = "a"\n')).train.engine == "torchft"
    spec = load_spec(_spec(tmp_path, 'name = "a"\n[train]\nengine = "torchrun"\n'))
    assert spec.train.engine == "torchrun"


def test_unknown_engine_is_one_line_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as e:
        load_spec(_spec(tmp_path, '[train]\nengine = "horovod"\n'))
    msg = str(e.value)
    assert "train.engine" in msg and "\n" not in msg.strip()


def _cfg(**kw: object) -> AgentConfig:
    base: dict[str, object] = dict(cluster="c", node_id="n3", head_url="http://127.0.0.1:1",
                                   store_host="127.0.0.1", store_port=2, token_file="t",
                                   workdir="/tmp/w", script="/p/train.py", args=["--x"],
                                   nproc_per_node=2, local_addr="127.0.0.5")
    base.update(kw)
    return AgentConfig(**base)  # type: ignore[arg-type]


def test_agent_config_checks_the_engine() -> None:
    with pytest.raises(ValueError, match="engine must be"):
        _cfg(engine="mpi")
    with pytest.raises(ValueError, match="lighthouse"):
        _cfg(engine="torchft")


def test_torchft_node_is_one_replica_group_with_its_own_torchrun() -> None:
    cmd = torchrun_command(_cfg(engine="torchft", lighthouse="http://127.0.0.1:9"), 4242)
    assert "--nnodes=1" in cmd and "--nproc-per-node=2" in cmd
    # its own one-node rendezvous (no shared one on the head), store on the node's address
    assert "--rdzv-backend=spotctl-node" in cmd and "--rdzv-endpoint=127.0.0.5:4242" in cmd
    assert not any(a.startswith("--master") for a in cmd)
    assert cmd[-4:] == ["-m", "spotctl.agent.launch", "/p/train.py", "--x"]  # warm zygote
    # and torchrun itself is forked by the zygote too (started through the launcher)
    assert cmd[1:5] == ["-m", "spotctl.agent.launch", "-m", "torch.distributed.run"]
    # the restart path: the shared rendezvous, torchrun forked by the zygote as well
    old = torchrun_command(_cfg())
    assert "--rdzv-backend=spotctl" in old and "--rdzv-endpoint=127.0.0.1:2" in old
    assert old[1:5] == ["-m", "spotctl.agent.launch", "-m", "torch.distributed.run"]


@pytest.mark.skipif(not HAVE_FT, reason="torchft is not installed (the 'ft' extra)")
def test_lighthouse_binds_the_head_address_only() -> None:
    from spotctl.head.lighthouse import Lighthouse

    lh = Lighthouse("127.0.0.1")
    try:
        assert lh.address == f"http://127.0.0.1:{lh.port}"
        with socket.create_connection(("127.0.0.1", lh.port), timeout=2):
            pass
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", lh.port), timeout=2).close()
    finally:
        lh.stop()


def test_bad_lighthouse_timing_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from spotctl.head.lighthouse import LighthouseTiming

    monkeypatch.setenv("SPOTCTL_FT_JOIN_TIMEOUT_MS", "soon")
    with pytest.raises(ValueError, match="SPOTCTL_FT_JOIN_TIMEOUT_MS must be"):
        LighthouseTiming.from_env()


@pytest.mark.skipif(not HAVE_FT, reason="torchft is not installed (the 'ft' extra)")
def test_head_runs_the_lighthouse_only_when_asked(tmp_path: Path) -> None:
    from spotctl.head.server import HeadServer

    off = HeadServer(tmp_path / "a", "tok", with_store=False)
    assert off.lighthouse is None
    on = HeadServer(tmp_path / "b", "tok", with_store=False, lighthouse_port=0)
    (tmp_path / "b").mkdir()
    t = threading.Thread(target=on.serve, daemon=True)
    t.start()
    try:
        p = tmp_path / "b" / "head.json"
        for _ in range(200):
            if p.exists():
                break
            threading.Event().wait(0.02)
        assert on.lighthouse is not None
        assert json.loads(p.read_text())["lighthouse"] == on.lighthouse.address
    finally:
        on.stop()
        t.join(10)


@pytest.mark.skipif(not HAVE_FT, reason="torchft is not installed (the 'ft' extra)")
def test_head_lighthouse_runs_apart_and_comes_back(tmp_path: Path) -> None:
    """The head's Lighthouse (and its filter) run in a process of their own, so its quorums
    do not wait on the API's threads for the interpreter lock; killed, it starts again on
    the same port and a Manager's quorum request gets an answer there, and the journal
    says so."""
    import os
    import signal
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    from spotctl.head.server import HeadServer
    from tests.conftest import wait_until

    head = HeadServer(tmp_path / "h", "tok", with_store=False, lighthouse_port=0)
    (tmp_path / "h").mkdir()
    t = threading.Thread(target=head.serve, daemon=True)
    t.start()

    def quorum() -> int:
        c = LighthouseClient(lh.address, connect_timeout=timedelta(seconds=5))
        c.heartbeat("r0")
        q = c.quorum(replica_id="r0", timeout=timedelta(seconds=10), address="a",
                     store_address="s", step=1, world_size=1)
        return len(q.participants)

    try:
        lh = head.lighthouse
        assert lh is not None
        first = lh._proc.pid
        assert first != os.getpid()
        assert quorum() == 1
        port = lh.port
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: lh.alive() and lh._proc.pid != first, 30,
                   "the head to start its Lighthouse again")
        assert lh.port == port
        assert quorum() == 1
        assert any(e["type"] == "lighthouse-restarted" for e in head.coord.events)
    finally:
        head.stop()
        t.join(10)
    assert not lh.alive()
