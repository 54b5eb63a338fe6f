"""`spotctl ssh` lookups and errors (the happy path runs in test_e2e against real sshd)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotctl.state import NodeRow, Store

pytestmark = pytest.mark.ssh


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SPOTCTL_HOME=str(home), NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "spotctl.cli.app", "ssh", *args], env=env,
                          text=True, capture_output=True, timeout=60)  # fmt: skip


def _node(cluster: str, nid: str, provider: str, meta: dict[str, object]) -> NodeRow:
    return NodeRow(nid, cluster, provider, "z", "t", 1, "running", 0.0, 0.0, time.time(), None,
                   "r", "127.0.0.1", meta)  # fmt: skip


def test_ssh_errors(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    st = Store(home)
    for c, prov in (("a", "ssh"), ("b", "ssh"), ("loc", "local")):
        st.upsert_cluster(c, prov, {}, "running")
    st.upsert_node(_node("a", "n1", "ssh", {"address": "127.0.0.1", "port": 1}))
    st.upsert_node(_node("b", "n1", "ssh", {"address": "127.0.0.1", "port": 1}))
    st.upsert_node(_node("a", "n2", "ssh", {"address": "127.0.0.1", "port": 1}))
    st.upsert_node(_node("loc", "l1", "local", {}))
    st.close()

    p = _cli(home, "nope")
    assert p.returncode == 3 and "no live node 'nope' in any cluster" in p.stderr
    p = _cli(home, "n1")
    assert p.returncode == 2 and "several clusters (a, b); pass --name" in p.stderr
    p = _cli(home, "n1", "--name", "zz")
    assert p.returncode == 3 and "no cluster named 'zz'" in p.stderr
    p = _cli(home, "l1")
    assert p.returncode == 2 and "local process tree" in p.stderr
    # never contacted: no pinned key, so no blind first connection from `spotctl ssh`
    p = _cli(home, "n2")
    assert p.returncode == 3 and "no pinned host key yet" in p.stderr
