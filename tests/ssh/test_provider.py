"""The `ssh` provider over real sshd instances: join, bootstrap (real head and agent),
a notice file reaching the head, release, cleanup."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from spotctl.errors import CapacityError
from spotctl.providers import get_provider
from spotctl.providers.base import ProviderContext
from spotctl.providers.ssh.provider import SshProvider, host_ids
from spotctl.spec import ClusterSpec, SshHost
from spotctl.state import Store

from .conftest import SshdFactory

pytestmark = pytest.mark.ssh


def _status(head_url: str, token: str) -> dict[str, Any]:
    req = urllib.request.Request(
        head_url + "/api/status", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        return dict(json.load(r))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_host_ids_are_stable_and_unique() -> None:
    hosts = [SshHost(address="10.0.0.5"), SshHost(address="10.0.0.5"),
             SshHost(address="Box.Example", port=2222)]  # fmt: skip
    assert [i for i, _ in host_ids(hosts)] == [
        "ssh-10-0-0-5-22", "ssh-10-0-0-5-22-2", "ssh-box-example-2222"
    ]  # fmt: skip


@pytest.mark.slow  # real agents bootstrapped over sshd
def test_join_bootstrap_notice_release(
    sshd_factory: SshdFactory, client_key: Path, tmp_path: Path
) -> None:
    a, b = sshd_factory.start(), sshd_factory.start()
    script = tmp_path / "project" / "idle_train.py"
    script.parent.mkdir()
    script.write_text("import time\ntime.sleep(3600)\n")
    notice = tmp_path / "evict-b"
    spec = ClusterSpec.model_validate({
        "name": "byo", "provider": "ssh", "gpus": "1..2",
        "train": {"script": str(script), "python": sys.executable},
        "ssh": {"hosts": [
            {"address": "127.0.0.1", "port": a.port, "key": str(client_key)},
            {"address": "127.0.0.1", "port": b.port, "key": str(client_key),
             "notice_file": str(notice)},
        ]},
    })  # fmt: skip
    (tmp_path / "home").mkdir(mode=0o700)
    store = Store(tmp_path / "home")
    remote = tmp_path / "remote"
    ctx = ProviderContext("byo", spec, store.cluster_dir("byo"),
                          {"ssh_remote_root": str(remote), "ssh_wait_s": 5,
                           "ssh_heartbeat_timeout_s": 60})  # fmt: skip
    prov = get_provider("ssh", ctx)
    assert isinstance(prov, SshProvider)

    offers = prov.offers()
    assert [(o.provider, o.zone, o.instance_type, o.spot_price) for o in offers] == [
        ("ssh", "127.0.0.1", "ssh", 0.0)
    ] * 2
    joined = prov.launch(offers[0], 2, "req-1")
    ids = [i.id for i in joined]
    assert ids == [f"ssh-127-0-0-1-{a.port}", f"ssh-127-0-0-1-{b.port}"]
    assert [i.id for i in prov.launch(offers[0], 2, "req-1")] == ids, "idempotent by request"
    assert prov.offers() == []
    with pytest.raises(CapacityError, match="no free host at 127.0.0.1"):
        prov.launch(offers[0], 1, "req-2")
    assert [i.id for i in prov.list("byo")] == ids
    assert [i.spot for i in joined] == [False, True]
    assert prov.list("other") == []

    prov.prepare()
    head = prov.ensure_head()
    try:
        results = prov.bootstrap(joined)
        assert all(r.ok for r in results), [r.reason for r in results]
        token = store.cluster_dir("byo").token()
        st = _status(head.url, token)
        assert set(ids) <= set(st["nodes"])

        da, db = remote / "byo" / ids[0], remote / "byo" / ids[1]
        cfg_b = json.loads((db / "agent.json").read_text())
        assert (cfg_b["metadata"], cfg_b["notice_file"]) == ("file", str(notice))
        assert cfg_b["script"] == f"{db}/train/idle_train.py"
        assert (db / "train" / "idle_train.py").read_text() == script.read_text()
        assert cfg_b["token_file"] == f"{db}/token"
        assert stat.S_IMODE((db / "token").stat().st_mode) == 0o600
        assert json.loads((da / "agent.json").read_text())["metadata"] == "none"

        # re-running the bootstrap is a no-op
        again = prov.bootstrap(joined)
        assert [(r.ok, r.changed) for r in again] == [(True, False)] * 2, again

        # the host's own eviction signal reaches the head through the agent
        notice.write_text(json.dumps({"deadline": time.time() + 60}))
        deadline = time.monotonic() + 60
        while not _status(head.url, token)["nodes"][ids[1]].get("notice"):
            assert time.monotonic() < deadline, "notice file never reached the head"
            time.sleep(0.5)
        assert not _status(head.url, token)["nodes"][ids[0]].get("notice")

        # release one host: agent stopped, token gone, machine untouched otherwise
        pid_a = int((da / "agent.pid").read_text())
        prov.terminate([ids[0]])
        assert not _alive(pid_a)
        assert not (da / "token").exists() and (da / "agent.json").exists()
        assert [i.id for i in prov.list("byo")] == ids[1:]
        prov.terminate([ids[0]])  # already released: no-op
    finally:
        pid_b = db_pid = None
        p = remote / "byo" / ids[1] / "agent.pid"
        if p.exists():
            pid_b = db_pid = int(p.read_text())
        leaks = prov.cleanup()
    assert leaks == []
    assert prov.list("byo") == []
    if db_pid:
        assert not _alive(db_pid), pid_b
