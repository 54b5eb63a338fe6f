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
    assert rdzv.round_size(str(gate)) == 0
    for name in ("rdzv-gate.round-2-3", "rdzv-gate.round-10-4", "rdzv-gate.round-9-7",
                 "rdzv-gate.round-x-9", "other.round-99-9", "rdzv-gate.round-11-"):
        (tmp_path / name).touch()
    assert rdzv.round_size(str(gate)) == 4


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
