"""Two claims of docs/concepts.md (the checkpoint-then-rescale cycle) checked on real 2-rank gloo groups:

- "all ranks agree on the drain with one tiny all-reduce per step": a spy wrapped around
  torch.distributed's collectives (the real collective still runs) counts what
  spotctl.elastic.Run issues in each step of a training loop. A step without a periodic
  checkpoint issues exactly one collective, a 1-element all-reduce on the control group; a
  step that starts a checkpoint adds that save's collectives (on top of the one
  all-reduce), and only then does a collective run off the main thread.
- "a `COMMIT` marker written after every rank's data is on disk": rank 1's storage writer
  is slowed (and then made to fail). COMMIT appears only once rank 1's data is written,
  in sync and async saves, and never for a save in which rank 1's write failed."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from spotctl.elastic.checkpoint import COMMIT, Checkpointer, committed_steps, step_dir  # noqa: E402
from tests.elastic import harness  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object",
                "all_gather_into_tensor", "broadcast_object_list", "barrier", "gather",
                "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "monitored_barrier")


class CollectiveSpy:
    """Records every outermost call of a torch.distributed collective (name, thread, the
    loop's step, whether spotctl.elastic is on the stack) and runs the real one."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.step: Any = "init"
        self._local = threading.local()

    def install(self) -> None:
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, real: Any) -> Any:
        def spy(*args: Any, **kw: Any) -> Any:
            if getattr(self._local, "inside", False):  # e.g. all_gather_object's all_gathers
                return real(*args, **kw)
            main = threading.current_thread() is threading.main_thread()
            lib = not main  # only the library's checkpoint saves start threads here
            f: Any = sys._getframe(1)
            while f is not None and not lib:
                lib = "spotctl" in f.f_code.co_filename.replace("\\", "/").split("/")
                f = f.f_back
            group = kw.get("group", args[2] if name == "all_reduce" and len(args) > 2 else None)
            tensor = args[0] if args else kw.get("tensor")
            self.calls.append({
                "name": name, "step": self.step, "main": main, "lib": lib,
                "group": id(group) if group is not None else None,
                "numel": tensor.numel() if isinstance(tensor, torch.Tensor) else None,
            })
            self._local.inside = True
            try:
                return real(*args, **kw)
            finally:
                self._local.inside = False

        return spy


def _count_worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    harness.init_worker(rank, world, port)
    spy = CollectiveSpy()
    spy.install()
    model = harness.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = harness.data(cfg["n"])
    run = harness._make_run(model, opt, harness.make_sched(opt), harness.Counter(), None, cfg)
    i = 0
    while True:
        spy.step = i  # the collectives of loop iteration i, which trains step i + 1
        if not run.next_step():
            break
        opt.zero_grad()
        total = torch.zeros(1)
        for mb in run.micro_batches():
            loss = nn.functional.mse_loss(run.model(x[mb]), y[mb], reduction="sum")
            (loss * run.loss_scale).backward()
            total += loss.detach()
        opt.step()
        dist.all_reduce(total)  # the script's own collective: not the library's
        run.end_step(loss=total.item())
        i += 1
    spy.step = "finish"
    run.finish()
    ctl = id(run.ctl_pg)
    for c in spy.calls:
        c["ctl"] = c.pop("group") == ctl
    Path(f"{cfg['out']}.r{rank}").write_text(json.dumps({"steps": i, "calls": spy.calls}))


def test_one_tiny_all_reduce_per_step_and_checkpoint_collectives_only_on_save_steps(tmp_path):
    every, steps = 4, 10
    cfg = {"n": 64, "batch": 8, "seed": 0, "steps": steps, "every": every,
           "root": str(tmp_path / "ck"), "out": str(tmp_path / "o")}
    harness.spawn(_count_worker, 2, cfg)
    seen = []
    for rank in range(2):
        rec = json.loads(Path(f"{cfg['out']}.r{rank}").read_text())
        assert rec["steps"] == steps
        calls = rec["calls"]
        # the spy sees the script's own all-reduce each step (it is not the library's)
        mine = [c for c in calls if isinstance(c["step"], int) and not c["lib"]]
        assert [c["step"] for c in mine] == list(range(steps)), mine
        lib = [c for c in calls if isinstance(c["step"], int) and c["lib"]]
        # saves fall due at steps 4 and 8 (loop iterations 3 and 7); one due while the
        # save before it still writes (a loaded machine) is made at a later step instead
        saves = [i for i in range(steps)
                 if len([c for c in lib if c["step"] == i and c["main"]]) > 1]
        assert saves[0] == 3 and saves[1:] in ([], [7], [8], [9]), saves
        seen.append(saves)
        for i in range(steps):
            main = [c for c in lib if c["step"] == i and c["main"]]
            assert main, f"rank {rank} step {i}: no collective"
            # next_step's agreement comes first in every step: three int32 flags (a notice,
            # a timed checkpoint due, a save still uploading)
            drain = main[0]
            assert (drain["name"], drain["numel"], drain["ctl"]) == ("all_reduce", 3, True), main
            if i in saves:
                assert not any(c["name"] == "all_reduce" and c["ctl"] and c["numel"] == 3
                               for c in main[1:]), main
            else:
                assert main == [drain], f"rank {rank} step {i}: {main}"
        # off the main thread: only while a periodic save is in flight (started at a save
        # step, committed by a later next_step), never before the first
        off = sorted({c["step"] for c in lib if not c["main"]})
        assert off and min(off) >= saves[0], off
    assert seen[0] == seen[1], seen  # DCP's save is collective: every rank at one step


def _slow_writer(ck: Checkpointer, root: Path, out: Path, fail: set[int]) -> None:
    """Rank 1's storage writer: 1 s late; for the steps in `fail`, a write that raises.
    Records, once its data is written, whether COMMIT existed already."""
    real_writer = ck.store.writer

    def writer(step: int) -> Any:
        w = real_writer(step)
        real = w.write_data

        def write_data(plan: Any, planner: Any) -> Any:
            time.sleep(1.0)
            if step in fail:
                raise OSError(f"rank 1 could not write step {step}")
            fut = real(plan, planner)
            fut.wait()
            written = sorted(p.name for p in step_dir(root, step).glob("__1_*"))
            commit = (step_dir(root, step) / COMMIT).exists()
            with out.open("a") as f:
                f.write(json.dumps({"step": step, "t": time.time(), "files": written,
                                    "commit_already": commit}) + "\n")
            return fut

        w.write_data = write_data
        return w

    ck.store.writer = writer  # type: ignore[method-assign]


def _commit_worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    harness.init_worker(rank, world, port)
    pg = dist.new_group(backend="gloo")
    ck = Checkpointer(root, keep_last=5, rank=rank, pg=pg, mode="thread")
    if rank == 1:
        _slow_writer(ck, Path(root), Path(out), fail={30, 40})
    res = {}

    def state(v: float) -> dict[str, Any]:
        return {"model": {"w": torch.full((64, 64), v + rank)}}

    res["sync_ok"] = ck.save_sync(10, state(10), {"epoch": 0, "offset": 0})
    ck.save_async(20, state(20), {"epoch": 0, "offset": 0})
    ck.wait_pending()
    res["sync_failed"] = ck.save_sync(30, state(30), {"epoch": 0, "offset": 0})
    ck.save_async(40, state(40), {"epoch": 0, "offset": 0})
    ck.wait_pending()
    ck.close()
    dist.barrier()
    Path(f"{out}.r{rank}").write_text(json.dumps(res))
    dist.destroy_process_group()


def test_commit_only_after_every_ranks_data_and_never_when_a_rank_failed(tmp_path):
    root, out = tmp_path / "ck", tmp_path / "r1.jsonl"
    harness.spawn(_commit_worker, 2, str(root), str(out))
    res = [json.loads(Path(f"{out}.r{r}").read_text()) for r in range(2)]
    assert [r["sync_ok"] for r in res] == [True, True]
    assert [r["sync_failed"] for r in res] == [False, False]
    done = {d["step"]: d for d in map(json.loads, out.read_text().splitlines())}
    assert sorted(done) == [10, 20]  # 30 and 40 failed on rank 1
    for step in (10, 20):  # sync, async
        d = done[step]
        assert d["files"], f"step {step}: rank 1 wrote no data file"
        assert d["commit_already"] is False, f"step {step}: COMMIT before rank 1's data"
        commit = step_dir(root, step) / COMMIT
        assert json.loads(commit.read_text())["committed_at"] >= d["t"]
        for name in d["files"]:
            assert (step_dir(root, step) / name).stat().st_mtime_ns <= commit.stat().st_mtime_ns
    # rank 1's write failed: no COMMIT for those steps, and rank 0 removed their data
    assert committed_steps(str(root)) == [20, 10]
    assert not step_dir(root, 30).exists() and not step_dir(root, 40).exists()
