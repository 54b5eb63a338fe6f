"""The gated rendezvous handler (spotctl.elastic.rdzv) once its node has a notice: it
joins no new round, and leaving does not close the rendezvous for the other nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from spotctl.elastic import rdzv  # noqa: E402


class Inner:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def next_rendezvous(self) -> str:
        self.calls.append("next")
        return "round"

    def shutdown(self) -> bool:
        self.calls.append("shutdown")
        return True


def test_gate_open_joins_and_shuts_down(tmp_path: Path) -> None:
    gate = tmp_path / "rdzv-gate"
    gate.touch()
    inner = Inner()
    h = rdzv.GatedHandler(inner, str(gate))
    assert h.next_rendezvous() == "round" and h.shutdown()
    assert inner.calls == ["next", "shutdown"]


def test_leaving_node_refuses_new_rounds_and_keeps_rendezvous_open(tmp_path: Path) -> None:
    gate = tmp_path / "rdzv-gate"
    gate.touch()
    Path(str(gate) + ".leaving").touch()
    inner = Inner()
    h = rdzv.GatedHandler(inner, str(gate))
    with pytest.raises(rdzv.NodeLeaving):
        h.next_rendezvous()
    assert h.shutdown() is True
    assert inner.calls == []  # neither joined nor closed the rendezvous


def test_notice_while_waiting_at_a_closed_gate(tmp_path: Path) -> None:
    gate = tmp_path / "rdzv-gate"  # never opened
    Path(str(gate) + ".leaving").touch()
    h = rdzv.GatedHandler(Inner(), str(gate))
    with pytest.raises(rdzv.NodeLeaving):
        h.next_rendezvous()


def test_real_c10d_rendezvous_stays_open_after_a_leaver_shuts_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    # port 0: the store binds a free port itself (no pick-then-bind race with other tests)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    port = store.port
    params = RendezvousParameters(backend="spotctl", endpoint=f"127.0.0.1:{port}",
                                  run_id="t", min_nodes=1, max_nodes=3)

    def handler(gate: Path):  # type: ignore[no-untyped-def]
        monkeypatch.setenv("SPOTCTL_RDZV_GATE", str(gate))
        return rdzv.get_handler()(params)

    leaver_gate = tmp_path / "a-gate"
    Path(str(leaver_gate) + ".leaving").touch()
    leaver = handler(leaver_gate)
    leaver.shutdown()  # torchrun does this on any non-signal exit
    assert not handler(tmp_path / "b-gate").is_closed()
    # without a notice, shutdown closes it (torchrun's own behaviour, kept)
    handler(tmp_path / "c-gate").shutdown()
    assert handler(tmp_path / "d-gate").is_closed()
    del store


def test_round_size_is_the_newest_drains(tmp_path: Path) -> None:
    gate = tmp_path / "rdzv-gate"
    assert rdzv.newest_round(str(gate)) == (-1, 0)
    for name in ("rdzv-gate.round-2-3", "rdzv-gate.round-10-4", "rdzv-gate.round-9-7",
                 "rdzv-gate.round-x-9", "other.round-99-9", "rdzv-gate.round-11-"):
        (tmp_path / name).touch()
    assert rdzv.newest_round(str(gate)) == (10, 4)


def test_a_round_forms_once_the_expected_nodes_are_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real c10d handlers (through spotctl's, each with its own gate): with the head's
    count of 3 beside the gates, three nodes form a round at once although torch's last
    call would hold it 60 s; a fourth that comes later finds it complete and waits in
    torch's wait list (which restarts the group with it), as a node after the last call."""
    import threading
    import time

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    params = RendezvousParameters(backend="spotctl", endpoint=f"127.0.0.1:{store.port}",
                                  run_id="r", min_nodes=1, max_nodes=8,
                                  last_call_timeout=60, join_timeout=120)
    handlers = []
    for k in range(4):
        gate = tmp_path / f"n{k}" / "rdzv-gate"
        gate.parent.mkdir()
        gate.touch()
        (gate.parent / "rdzv-gate.round-1-3").touch()  # the agents' file at the drain
        monkeypatch.setenv("SPOTCTL_RDZV_GATE", str(gate))
        handlers.append(rdzv.get_handler()(params))
    ranks: dict[int, int] = {}
    errors: dict[int, Exception] = {}

    def join(k: int) -> None:
        try:
            ranks[k] = handlers[k].next_rendezvous().rank
        except Exception as e:  # noqa: BLE001 - the late node, once the rendezvous closes
            errors[k] = e

    threads = [threading.Thread(target=join, args=(k,), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    end = time.monotonic() + 30  # (without the expected count: 60 s of last call)
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    assert sorted(ranks.values()) == [0, 1, 2], ranks
    late = threading.Thread(target=join, args=(3,), daemon=True)
    late.start()
    deadline = 30.0
    while handlers[0].num_nodes_waiting() != 1 and deadline > 0:
        deadline -= 0.1
        late.join(0.1)
    assert handlers[0].num_nodes_waiting() == 1 and 3 not in ranks
    handlers[0].set_closed()  # ends the late node's wait
    late.join(30)
    assert set(errors) <= {3}, errors
    del store


def _c10d_handlers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int,
                   expected: int, run_id: str):  # type: ignore[no-untyped-def]
    """`count` real c10d handlers through spotctl's on one store, torch's last call 1 s
    (as spotctl sets it), each with its own gate and the head's count of `expected`."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    params = RendezvousParameters(backend="spotctl", endpoint=f"127.0.0.1:{store.port}",
                                  run_id=run_id, min_nodes=1, max_nodes=8,
                                  last_call_timeout=1, join_timeout=120)
    handlers = []
    for k in range(count):
        gate = tmp_path / f"n{k}" / "rdzv-gate"
        gate.parent.mkdir()
        gate.touch()
        (gate.parent / f"rdzv-gate.round-1-{expected}").touch()
        monkeypatch.setenv("SPOTCTL_RDZV_GATE", str(gate))
        handlers.append(rdzv.get_handler()(params))
    return store, handlers


def _join_all(handlers, delays: list[float], wait_s: float):  # type: ignore[no-untyped-def]
    """Each handler's next_rendezvous in a thread of its own, started `delays[k]` s after
    the first; {k: (rank, world, seconds from the start)} of those that got a round."""
    import threading
    import time

    t0 = time.monotonic()
    got: dict[int, tuple[int, int, float]] = {}

    def join(k: int) -> None:
        time.sleep(delays[k])
        try:
            info = handlers[k].next_rendezvous()
            got[k] = (info.rank, info.world_size, time.monotonic() - t0)
        except Exception:  # noqa: BLE001 - the rendezvous closed under a waiting node
            pass

    threads = [threading.Thread(target=join, args=(k,), daemon=True)
               for k in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + wait_s - time.monotonic()))
    return got


def test_a_round_waits_for_an_announced_node_past_the_last_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI: a joiner's torchrun came to the round more than torch's last call (1 s) after
    the survivors; they formed it without it, and the group restarted a second time for
    it. With the head's count (3), the round waits for the third node, 3 s late."""
    store, handlers = _c10d_handlers(tmp_path, monkeypatch, 3, 3, "late")
    got = _join_all(handlers, [0.0, 0.0, 3.0], wait_s=30)
    handlers[0].set_closed()
    assert sorted(r for r, _, _ in got.values()) == [0, 1, 2], got
    assert {w for _, w, _ in got.values()} == {3}, got
    del store


def test_a_round_waits_for_announced_nodes_only_so_long(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An announced node that never comes (it died in the drain) holds the round up to
    ROUND_HOLD_S past the last call, not until torch's join timeout."""
    monkeypatch.setattr(rdzv, "ROUND_HOLD_S", 3.0)
    store, handlers = _c10d_handlers(tmp_path, monkeypatch, 2, 3, "short")
    got = _join_all(handlers, [0.0, 0.0], wait_s=30)
    handlers[0].set_closed()
    assert sorted(r for r, _, _ in got.values()) == [0, 1], got
    took = [t for _, _, t in got.values()]
    # last call (1 s) + the hold (3 s); well short of the 120 s join timeout
    assert all(3.5 < t < 20 for t in took), got
    del store


def test_a_drains_count_is_used_for_one_round(tmp_path: Path) -> None:
    """After a kill there is no drain: the round that follows must not wait for the count
    of the last drain (its nodes may be gone). A new drain's count is used again."""
    gate = tmp_path / "rdzv-gate"
    gate.touch()
    h = rdzv.GatedHandler(Inner(), str(gate))
    (tmp_path / "rdzv-gate.round-4-3").touch()
    h.next_rendezvous()
    assert rdzv._expected[0] == 3
    h.next_rendezvous()  # a kill's round: no new drain
    assert rdzv._expected[0] == 0
    (tmp_path / "rdzv-gate.round-5-2").touch()
    h.next_rendezvous()
    assert rdzv._expected[0] == 2
