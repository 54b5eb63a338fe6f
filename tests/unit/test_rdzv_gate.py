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
