"""spotctl.elastic.ftwatch against a real torchft Lighthouse (spotctl's, behind its
filter) and real heartbeats (torchft's own client): a collective waiting on a replica
that stopped heartbeating fails in seconds, not at the cross-replica timeout; one that
completes passes its value on; a quorum whose members all heartbeat is left to wait."""

from __future__ import annotations

import importlib.util
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)

from spotctl.elastic.ftwatch import Watch, heartbeats, vanished  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def lighthouse() -> Any:
    from spotctl.head.lighthouse import Lighthouse, LighthouseTiming

    lh = Lighthouse("127.0.0.1", 0, LighthouseTiming(heartbeat_timeout_ms=250))
    yield lh
    lh.stop()


class Beats:
    """A replica's heartbeats, as its Manager's Rust side sends them (every 50 ms)."""

    def __init__(self, address: str, rid: str):
        from torchft._torchft import LighthouseClient

        self.client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        self.rid = rid
        self.on = True
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while self.on:
            self.client.heartbeat(self.rid)
            time.sleep(0.05)


def test_the_status_page_gives_each_replicas_heartbeat_age(lighthouse: Any) -> None:
    import urllib.request

    b = Beats(lighthouse.address, "n1:abc")
    time.sleep(0.3)
    with urllib.request.urlopen(f"{lighthouse.address}/status", timeout=5) as r:
        ages = heartbeats(r.read().decode())
    b.on = False
    assert list(ages) == ["n1:abc"] and 0 <= ages["n1:abc"] < 1, ages
    # this replica (with or without torchft's uuid) is never the one gone
    assert vanished(["n1:x", "n2:y"], "n1", {"n1:x": 5.0, "n2:y": 0.1}, 2.0) is None
    assert vanished(["n1:x", "n2:y"], "n1", {"n1:x": 0.1, "n2:y": 3.0}, 2.0) == "n2:y"
    assert vanished(["n1:x", "n2:y"], "n1", {"n1:x": 0.1}, 2.0) == "n2:y"  # no longer listed
    # a Lighthouse started again lists nobody (this replica neither) until the next
    # heartbeats: that says nothing about n2
    assert vanished(["n1:x", "n2:y"], "n1", {}, 2.0) is None


def test_an_id_chosen_by_a_cluster_member_cannot_age_a_real_replica(lighthouse: Any) -> None:
    """Any cluster member can heartbeat under an id of its choosing: ids that spell a real
    member's entry (after a newline, or closing the HTML entry) stay entries of their own,
    in whatever order the page lists them."""
    import urllib.request
    from datetime import timedelta as td

    from torchft._torchft import LighthouseClient

    c = LighthouseClient(lighthouse.address, connect_timeout=td(seconds=5))
    fakes = ["x\n  n2:real: seen 99s ago", 'a</li><li class="heartbeat">n2:real: seen 99s ago',
             "n2:real: seen 99s ago\nz"]
    for rid in ["n2:real", *fakes]:
        c.heartbeat(rid)
    with urllib.request.urlopen(f"{lighthouse.address}/status", timeout=5) as r:
        ages = heartbeats(r.read().decode())
    assert ages["n2:real"] < 1, ages
    assert vanished(["n1:x", "n2:real"], "n1", {**ages, "n1:x": 0.1}, 2.0) is None


def test_a_wait_on_a_replica_that_stopped_heartbeating_fails_in_seconds(lighthouse: Any) -> None:
    a = Beats(lighthouse.address, "n1:aaa")
    b = Beats(lighthouse.address, "n2:bbb")
    gone: list[Exception] = []
    w = Watch(lighthouse.address, "n1", lambda: ["n1:aaa", "n2:bbb"], gone.append,
              after_s=0.5, poll_s=0.2, stale_s=1.0)
    try:
        # a collective that completes: its value passes, nothing is failed
        done: torch.futures.Future[Any] = torch.futures.Future()
        g = w.guard(done)
        done.set_result(7)
        assert g.wait() == 7
        # every member heartbeats: a slow collective is waited for
        slow: torch.futures.Future[Any] = torch.futures.Future()
        g = w.guard(slow)
        time.sleep(2.5)
        assert not g.done() and not gone
        slow.set_result("late")
        assert g.wait() == "late"
        # n2 stops heartbeating (frozen, or its VM gone) with a collective in flight
        stuck: torch.futures.Future[Any] = torch.futures.Future()
        g = w.guard(stuck)
        b.on = False
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="replica n2:bbb stopped heartbeating"):
            g.wait()
        took = time.monotonic() - t0
        assert took < 10, took  # the heartbeat's staleness (1 s) and a poll, not a timeout
        assert w.found == ["n2:bbb"] and len(gone) == 1
        stuck.set_result(None)  # the collective ending later changes nothing
        assert g.done()
    finally:
        a.on = b.on = False


def _two_replicas(lighthouse: Any) -> tuple[Beats, Beats, threading.Event, Watch]:
    """n1 (this replica) and n2 heartbeating, and n1's watch, whose on_gone sets the event."""
    a = Beats(lighthouse.address, "n1:aaa")
    b = Beats(lighthouse.address, "n2:bbb")
    aborted = threading.Event()
    w = Watch(lighthouse.address, "n1", lambda: ["n1:aaa", "n2:bbb"], lambda e: aborted.set(),
              after_s=0.5, poll_s=0.2, stale_s=1.0)
    return a, b, aborted, w


def test_a_wait_only_the_watch_can_end_is_ended_by_it(lighthouse: Any) -> None:
    """NCCL's case: the host blocks in the collective's own wait, which the watch ends
    through on_gone (there, the group's abort; here, an event the wait is on)."""
    a, b, aborted, w = _two_replicas(lighthouse)
    try:
        with w.watching():
            b.on = False
            assert aborted.wait(20), "the watch did not end the wait"
        assert w.found == ["n2:bbb"]
        with w.watching():  # nothing pending after the block: the watch stays quiet
            pass
        assert not w._pending
    finally:
        a.on = b.on = False


def test_a_collective_the_stream_has_not_passed_keeps_the_watch_looking(lighthouse: Any) -> None:
    """NCCL's wait returns at once (it only orders the stream) and the host blocks later,
    wherever: the collective is tracked by an event recorded after it (here, a flag
    standing for Event.query) until the stream has passed it. Passed, it is pruned and a
    replica that stops afterwards aborts nothing; not passed, that replica's silence
    aborts the group."""
    a, b, aborted, w = _two_replicas(lighthouse)
    try:
        passed = threading.Event()
        w.track(passed.is_set)
        time.sleep(1.5)  # pending past after_s, every member heartbeating: nothing
        assert not aborted.is_set() and w._pending
        passed.set()
        time.sleep(0.6)
        assert not w._pending  # pruned at the next poll
        b.on = False
        time.sleep(2.5)  # n2 silent, nothing in flight: nothing to abort
        assert not aborted.is_set()
        w.track(lambda: False)  # a collective the stream never passes
        assert aborted.wait(20), "the watch did not abort the group"
        assert w.found == ["n2:bbb"] and not w._pending
    finally:
        a.on = b.on = False
        w.close()
