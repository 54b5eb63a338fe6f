"""A cloud head's reconcile loop (spotctl.head.rebalancer): the bundle `up` uploads becomes
the loop's own state directory, and the controller's pause holds the lock every run of
the loop takes (tried from another process, as the loop's child takes it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from spotctl.head.rebalancer import ON_HEAD_VAR, Rebalancer, import_bundle
from spotctl.spec import ClusterSpec
from spotctl.state import Store

SPEC = ClusterSpec.model_validate({
    "name": "c9", "provider": "aws", "gpus": "2..4",
    "aws": {"region": "us-east-1", "ssh_cidr": "127.0.0.1/32"},
    "rebalance": {"on_head_interval_s": 15},
}).model_dump(mode="json")  # fmt: skip


def _bundle(tmp: Path, age_s: float = 3600, **over: object) -> tuple[Path, Path]:
    """A head's node directory with a bundle uploaded `age_s` ago."""
    head = tmp / "node"
    head.mkdir(exist_ok=True)
    b = {"cluster": "c9", "provider": "aws", "spec": SPEC,
         "head": {"url": "http://10.0.0.5:29400", "store_host": "10.0.0.5",
                  "store_port": 29401, "instance_id": "i-0head", "lighthouse": ""},
         "files": {"id_ed25519": "KEY\n", "known_hosts": "10.0.0.7 ssh-ed25519 AAAA\n",
                   "ssh/id_gcp": "GKEY\n"},
         "interval_s": 15, "env": {}, "project_root": ""}  # fmt: skip
    b.update(over)
    (head / "rebalance.json").write_text(json.dumps(b))
    t = time.time() - age_s
    os.utime(head / "rebalance.json", (t, t))
    token = head / "token"
    token.write_text("tok-123\n")
    return head / "rebalance.json", token


def _lock_free(home: Path) -> bool:
    """Whether another process (as the loop's `rebalance --watch` would) gets the lock."""
    code = ("import sys; from pathlib import Path; from spotctl.state import ClusterDir\n"
            "try:\n"
            f"    with ClusterDir(Path({str(home)!r}), 'c9').lock('rebalance', wait=False):\n"
            "        pass\n"
            "except Exception as e:\n"
            "    print(e); sys.exit(1)\n")  # fmt: skip
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@contextmanager
def _run_in_progress(home: Path, seconds: float = 30) -> Iterator[subprocess.Popen[str]]:
    """Another process holds the loop's lock, as a run of the loop's child does, for
    `seconds` at most (ended when the block ends)."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import time; from pathlib import Path; from spotctl.state import ClusterDir\n"
         f"with ClusterDir(Path({str(home)!r}), 'c9').lock('rebalance', wait=False):\n"
         f"    print('held', flush=True); time.sleep({seconds})\n"],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_the_bundle_becomes_the_loops_state_directory(tmp_path: Path) -> None:
    bundle, token = _bundle(tmp_path)
    import_bundle(bundle, token)
    home = bundle.parent / "home"
    store = Store(home)
    row = store.get_cluster("c9")
    assert row.provider == "aws" and row.state == "running"
    assert ClusterSpec.model_validate(row.spec).gpus.max == 4
    assert row.head["url"] == "http://10.0.0.5:29400" and row.head["instance_id"] == "i-0head"
    cdir = store.cluster_dir("c9")
    assert cdir.token() == "tok-123"
    key = cdir.path / "id_ed25519"
    assert key.read_text() == "KEY\n" and key.stat().st_mode & 0o777 == 0o600
    assert (cdir.path / "ssh" / "id_gcp").read_text() == "GKEY\n"
    assert (cdir.path / "ssh").stat().st_mode & 0o777 == 0o700
    store.close()


@pytest.mark.parametrize("name", ["../escape", ".hidden", "a/b/c", "", "a/../b", "/abs",
                                  "ssh/.x"])
def test_a_bundle_file_outside_the_cluster_directory_is_refused(tmp_path: Path, name: str) -> None:
    bundle, token = _bundle(tmp_path, files={name: "x"})
    with pytest.raises(ValueError, match="bad file name"):
        import_bundle(bundle, token)
    assert not (tmp_path / "escape").exists()


def test_pause_holds_the_runs_lock_until_resume_and_a_new_bundle_is_taken(tmp_path: Path) -> None:
    bundle, token = _bundle(tmp_path)
    loop = Rebalancer.from_bundle(bundle, token, tmp_path / "rebalance.log")
    home = bundle.parent / "home"
    assert loop.interval_s == 15 and loop._env[ON_HEAD_VAR] == "i-0head"
    assert _lock_free(home)
    assert loop.pause(60, "laptop pid 7") == {"paused": True, "ttl_s": 60}
    assert loop.status()["paused"] and loop.status()["paused_by"] == "laptop pid 7"
    assert not _lock_free(home)  # the loop's next run steps aside
    assert loop.pause(60, "again")["paused"]  # a second pause extends the first
    # `up` uploaded a new spec meanwhile: resume takes it
    spec = dict(SPEC, gpus={"min": 2, "max": 8})
    _bundle(tmp_path, age_s=1800, spec=spec, interval_s=20)
    assert loop.resume() == {"paused": False}
    assert _lock_free(home) and not loop.status()["paused"]
    store = Store(home)
    assert ClusterSpec.model_validate(store.get_cluster("c9").spec).gpus.max == 8
    assert loop.interval_s == 20
    store.close()


def test_a_head_started_with_a_fresh_bundle_waits_for_the_up_that_started_it(
    tmp_path: Path,
) -> None:  # fmt: skip
    """`up` uploads the bundle, starts the head, then launches the first nodes: the loop
    must not launch them too, so it starts paused until that `up` resumes it."""
    bundle, token = _bundle(tmp_path, age_s=1)
    loop = Rebalancer.from_bundle(bundle, token, tmp_path / "rebalance.log")
    assert loop.status()["paused"] and "up" in loop.status()["paused_by"]
    assert not _lock_free(bundle.parent / "home")
    assert loop.pause(60, "the same up")["paused"]  # what that `up` then asks
    loop.resume()
    assert _lock_free(bundle.parent / "home")


def test_a_run_in_progress_is_not_paused_and_a_pause_ends_by_itself(tmp_path: Path) -> None:
    bundle, token = _bundle(tmp_path)
    loop = Rebalancer.from_bundle(bundle, token, tmp_path / "rebalance.log")
    home = bundle.parent / "home"
    # a run of the loop holds the lock (another process): the pause says so, and waits not
    with _run_in_progress(home):
        r = loop.pause(60, "laptop")
        assert r["paused"] is False and "another rebalance is running" in r["busy"], r
    assert loop.pause(1, "laptop")["paused"]
    assert not _lock_free(home)
    deadline = time.monotonic() + 15
    while not _lock_free(home):
        assert time.monotonic() < deadline, "the pause never ran out"
        time.sleep(0.2)
    assert not loop.status()["paused"]


class Sleeping(Rebalancer):
    """The loop with a stand-in command that never reconciles (this test is about the
    lock between the controller and the loop, not about a run)."""

    def argv(self) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def test_the_controller_pauses_the_heads_loop_while_it_acts(tmp_path: Path) -> None:
    """reconcile.head_loop_paused against a real head API: the controller's `up` or
    `rebalance` waits for the loop's run in progress, holds the loop's lock while it acts,
    and gives it back; `down`'s pause is never given back."""
    from spotctl.control.reconcile import head_loop_paused
    from tests.security.conftest import serve_head

    bundle, token = _bundle(tmp_path)
    loop = Sleeping.from_bundle(bundle, token, tmp_path / "rebalance.log")
    home = bundle.parent / "home"
    ctl = Store(tmp_path / "controller")
    (tmp_path / "headdir").mkdir()
    with serve_head(tmp_path / "headdir", "tok-123", rebalancer=loop) as srv:
        ctl.upsert_cluster("c9", "aws", SPEC, "running")
        ctl.set_head("c9", {"url": srv.url, "store_host": "127.0.0.1", "store_port": 1})
        ctl.cluster_dir("c9").ensure().token_file.write_text("tok-123\n")
        spec = ClusterSpec.model_validate(SPEC)
        said: list[str] = []
        # a run of the loop in progress: the controller waits for its end
        with _run_in_progress(home, seconds=2) as holder:
            t0 = time.monotonic()
            with head_loop_paused(ctl, spec, None, lambda m, _f: said.append(m)) as paused:
                assert paused and time.monotonic() - t0 > 0.5
                assert any("waiting for the head's reconcile run" in m for m in said), said
                assert not _lock_free(home)
                assert loop.status()["paused"]
            assert holder.wait() == 0  # its run ended by itself first
        assert _lock_free(home) and not loop.status()["paused"]
        # `down` does not wait forever for a run that does not end: it says so, goes on
        with _run_in_progress(home):
            said.clear()
            with head_loop_paused(ctl, spec, None, lambda m, _f: said.append(m), wait_s=1.5,
                                  resume=False, must=False) as p:  # fmt: skip
                assert not p
            assert any("going on without pausing it" in m for m in said), said
            with pytest.raises(Exception, match="did not end within"):
                with head_loop_paused(ctl, spec, None, lambda m, _f: None, wait_s=1.0):
                    pass
        # the head's own loop never pauses itself
        with head_loop_paused(ctl, spec, {"on_head": "i-0head"}, lambda m, _f: None) as p:
            assert not p
        # `down`: paused for good (the head goes with the cluster)
        with head_loop_paused(ctl, spec, None, lambda m, _f: None, resume=False) as p:
            assert p
        assert not _lock_free(home)
        loop.resume()
    ctl.close()



def test_a_pause_is_capped_and_down_keeps_the_loop_paused_through_its_cleanup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One head with its loop, through its real API:

    kills: the pause TTL cap dropped (`min(..., MAX_PAUSE_S)` in Rebalancer.pause). The
    API takes a ttl_s up to 1e6 s (11 days); the loop holds a pause 3 h at most, so a
    controller that dies mid-run (or a credential that asks for days) cannot stop
    replacements for longer. Bounded both ways.

    kills: `down` resuming the head's loop before its cleanup (resume=True in teardown's
    head_loop_paused): the loop could launch replacements while the nodes are being
    terminated. Judged by the loop itself (its lock, held by the pause, as a run of the
    loop would find it), during the provider's cleanup and after `down`."""
    from spotctl.control import cron, reconcile
    from spotctl.head.client import HeadClient
    from spotctl.head.rebalancer import MAX_PAUSE_S
    from tests.security.conftest import serve_head

    bundle, token = _bundle(tmp_path)
    loop = Sleeping.from_bundle(bundle, token, tmp_path / "rebalance.log")
    home = bundle.parent / "home"
    ctl = Store(tmp_path / "controller")
    (tmp_path / "headdir").mkdir()
    seen: list[tuple[bool, bool]] = []

    class Provider:
        def cleanup(self) -> list[str]:
            seen.append((loop.status()["paused"], _lock_free(home)))
            return []

    monkeypatch.setattr(reconcile, "provider_for", lambda *a, **k: Provider())
    monkeypatch.setattr(cron, "remove", lambda name: None)  # this machine's crontab: not ours
    with serve_head(tmp_path / "headdir", "tok-123", rebalancer=loop) as srv:
        client = HeadClient(srv.url, "tok-123", timeout_s=10)
        t0 = time.monotonic()
        got = client.pause_loop(999_999, "laptop")
        assert got == {"paused": True, "ttl_s": MAX_PAUSE_S} and MAX_PAUSE_S == 3 * 3600.0
        assert t0 + MAX_PAUSE_S - 60 <= loop._pause_until <= time.monotonic() + MAX_PAUSE_S
        assert client.pause_loop(0.001, "laptop")["ttl_s"] == 1.0  # and at least 1 s
        assert client.pause_loop(1800, "laptop")["ttl_s"] == 1800  # within: as asked
        client.resume_loop()
        assert not loop.status()["paused"]

        ctl.upsert_cluster("c9", "aws", SPEC, "running")
        ctl.set_head("c9", {"url": srv.url, "store_host": "127.0.0.1", "store_port": 1})
        ctl.cluster_dir("c9").ensure().token_file.write_text("tok-123\n")
        assert _lock_free(home)
        assert reconcile.teardown(ctl, "c9").leaks == []
        assert seen == [(True, False)], seen  # paused, its lock held, while cleaning up
        assert loop.status()["paused"] and not _lock_free(home)  # and after: for good
        assert ctl.get_cluster("c9").state == "down"
        loop.resume()
    ctl.close()
