"""What a torchft heal loads from a peer (spotctl.elastic.peerload): the metadata of the
states users really train (optimizers, LR schedules, a GradScaler, numpy's RNG, FSDP2's
DTensors) loads as before; a pickle that would run code, import a module or load a tensor
with torch's full unpickler is refused before anything of it runs, through torchft's own
PGTransport over a real gloo group."""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.conftest import free_port
from tests.elastic.harness import single_rank_group

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the 'ft' extra)", allow_module_level=True)

from torchft.checkpointing import pg_transport  # noqa: E402
from torchft.checkpointing.pg_transport import PGTransport, _prepare_state_dict  # noqa: E402

from spotctl.elastic import _rng_state, peerload  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class _Run:
    """Runs a shell command when unpickled (the payload of a fake replica)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


class Custom:
    """A user's own class in the state passed to spotctl.elastic."""

    def __init__(self, n: int = 0):
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.n == self.n


def _users_state() -> dict[str, Any]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    adam = torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.1), weight_decay=0.01)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(2, 4)).sum().backward()
    adam.step()
    sgd.step()
    scheds = [
        torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=1.0, total_steps=100),
        torch.optim.lr_scheduler.SequentialLR(adam, [
            torch.optim.lr_scheduler.LinearLR(adam), torch.optim.lr_scheduler.CosineAnnealingLR(adam, 10),
        ], milestones=[5]),
        torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0),
        torch.optim.lr_scheduler.ReduceLROnPlateau(sgd),
    ]  # fmt: skip
    np.random.seed(3)
    st = {"model": m.state_dict(), "optim": [adam.state_dict(), sgd.state_dict()],
          "schedulers": [s.state_dict() for s in scheds],
          "scaler": torch.amp.GradScaler("cpu").state_dict(), "rng": _rng_state(),
          "pos": {"step": 7, "epoch": 0, "offset": 12, "seed": 1, "global_batch": 8}}
    assert "numpy" in st["rng"]
    return {"user": {"default": st}, "torchft": {"step": 7, "batches_committed": 7}}


def _meta_bytes(state: Any) -> tuple[Any, bytes]:
    meta, _ = _prepare_state_dict(state, 7, torch.device("cpu"))
    return meta, pickle.dumps(meta)


def _same(a: Any, b: Any) -> None:
    assert a.step == b.step and a.paths == b.paths and a.treespec == b.treespec
    assert len(a.non_tensor_leaves) == len(b.non_tensor_leaves)
    for x, y in zip(a.non_tensor_leaves, b.non_tensor_leaves, strict=True):
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y)
        else:
            assert repr(x) == repr(y)


def test_the_metadata_of_what_users_train_loads_as_before() -> None:
    meta, data = _meta_bytes(_users_state())
    _same(peerload.loads(data), pickle.loads(data))
    _same(peerload.loads(data), meta)


def test_fsdp2_dtensor_metadata_loads_as_before() -> None:
    from torch.distributed.fsdp import fully_shard

    with single_rank_group():
        m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        fully_shard(m)
        opt = torch.optim.Adam(m.parameters())
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        meta, data = _meta_bytes({"model": m.state_dict(), "optim": opt.state_dict()})
        got = peerload.loads(data)
        assert any(isinstance(v, pg_transport._DTensorMeta) for v in got.non_tensor_leaves)
        _same(got, pickle.loads(data))


@pytest.mark.parametrize("payload", [
    "system",  # os.system through __reduce__
    "nested",  # the same inside an otherwise real state
    "getattr",  # builtins.getattr(builtins, 'exec')-style gadgets
    "torch_attr",  # a torch attribute that is not a dtype
    "inner_pickle",  # torch.storage._load_from_bytes over a pickle that runs code
])  # fmt: skip
def test_a_pickle_that_runs_code_is_refused_before_it_runs(tmp_path: Path, payload: str) -> None:
    marker = tmp_path / "ran"
    evil = _Run(marker)
    if payload == "system":
        data = pickle.dumps(evil)
    elif payload == "nested":
        state = _users_state()
        state["user"]["default"]["pos"]["seed"] = evil
        _, data = _meta_bytes(state)
    elif payload == "getattr":
        data = (b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntR"
                b"Vsystem\ntR(V" + f"touch {marker}".encode() + b"\ntR.")
    elif payload == "torch_attr":
        data = b"ctorch\nload\n."
    else:
        inner = pickle.dumps(evil)
        data = b"ctorch.storage\n_load_from_bytes\n(C" + bytes([len(inner)]) + inner + b"tR."
    with pytest.raises(pickle.UnpicklingError):
        peerload.loads(data)
    assert not marker.exists()
    if payload in ("system", "nested"):  # the gadget works with plain pickle (the test's check)
        pickle.loads(data)
        assert marker.exists()


def test_nothing_is_imported_for_a_peer() -> None:
    name = "spotctl_test_never_imported"
    data = f"c{name}\nThing\n.".encode()
    with pytest.raises(peerload.RefusedGlobal, match=name):
        peerload.loads(data)
    assert name not in sys.modules


def test_a_users_own_class_needs_naming(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _users_state()
    state["user"]["default"]["extra"] = Custom(5)
    _, data = _meta_bytes(state)
    with pytest.raises(peerload.RefusedGlobal, match=f"SPOTCTL_FT_HEAL_ALLOW as {__name__}:Custom"):
        peerload.loads(data)
    monkeypatch.setenv("SPOTCTL_FT_HEAL_ALLOW", f"posix:system, {__name__}:Custom")
    got = peerload.loads(data)
    assert [v.n for v in got.non_tensor_leaves if isinstance(v, Custom)] == [5]
    # a function stays refused, even named there
    with pytest.raises(peerload.RefusedGlobal, match="posix.system"):
        peerload.loads(pickle.dumps(_Run(Path("/nonexistent/x"))))


def _pair(fn0: Any, fn1: Any) -> tuple[Any, Any]:
    """Two ranks of torchft's gloo group in threads of this process: what each returned
    (or raised)."""
    from torchft import ProcessGroupGloo

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    out: list[Any] = [None, None]

    def rank(r: int, fn: Any) -> None:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
        pg.configure(f"127.0.0.1:{port}/heal", f"r{r}", r, 2)
        t = PGTransport(pg, timeout=timedelta(seconds=20), device=torch.device("cpu"))
        try:
            out[r] = fn(t)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[r] = e

    ts = [threading.Thread(target=rank, args=(r, f)) for r, f in enumerate((fn0, fn1))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    del store
    return out[0], out[1]


def test_torchfts_transport_refuses_a_fake_replicas_payload(tmp_path: Path) -> None:
    """Through PGTransport, as a heal runs: a real state arrives whole; a state carrying
    the payload is refused by the receiver and nothing runs."""
    marker = tmp_path / "ran"
    peerload.install()
    assert pg_transport.pickle.loads is peerload.loads
    t = timedelta(seconds=20)
    good = _users_state()
    _, got = _pair(lambda tr: tr.send_checkpoint([1], 7, good, t),
                   lambda tr: tr.recv_checkpoint(0, "<n/a>", 7, t))
    assert not isinstance(got, Exception), got
    for k, v in good["user"]["default"]["model"].items():
        assert torch.equal(got["user"]["default"]["model"][k], v), k

    evil = _users_state()
    evil["user"]["default"]["pos"]["seed"] = _Run(marker)
    # (the sender then waits out its timeout for tensors nobody receives)
    short = timedelta(seconds=2)
    _, got = _pair(lambda tr: tr.send_checkpoint([1], 7, evil, short),
                   lambda tr: tr.recv_checkpoint(0, "<n/a>", 7, t))
    assert isinstance(got, peerload.RefusedGlobal), got
    assert "posix.system" in str(got) or "os.system" in str(got)
    assert not marker.exists()
