"""13: the checkpoint disk fills up (a small tmpfs of the test's own): the save fails
cleanly, training goes on, older checkpoints stay intact, saves resume once space is back.
14: a node cut off from the network (nodes in network namespaces; its link goes down).
Both run on either engine (`engine`). On torchrun the replays are counted from the
workers' own sample trace (scripts/chaos_lib/replays.py; the head's figure stays in
detail). On torchft a step whose commit vote failed is run again in place, with no
restart and no rescale event: its replays are counted from the replicas' own reports
(failed_steps), and a replica process that changed fails the row; the head's figure is
kept in detail["head_lost_steps"] as a cross-check."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from . import replays
from .cluster import Cluster
from .result import Result

EVERY = 10


def _mount_tmpfs(path: Path, size: str) -> str | None:
    path.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    return None if p.returncode == 0 else (p.stderr.strip() or "mount failed")


def _fill(path: Path) -> int:
    """Write a filler file until the file system is full; returns bytes written.
    Unbuffered: a buffered file's close() would flush what the full disk refused and
    raise ENOSPC out of the harness itself."""
    n = 0
    for name, chunk in (("filler", 65536), ("filler2", 512)):  # then the last few bytes
        fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while True:
                w = os.write(fd, b"\0" * chunk)
                if not w:
                    break
                n += w
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def _snapshot(ck: Path, steps: list[int]) -> dict[int, dict[str, int]]:
    out = {}
    for s in steps:
        d = ck / f"step-{s:08d}"
        out[s] = {f.name: f.stat().st_size for f in d.iterdir()} if d.exists() else {}
    return out


def _replayed_on_torchft(c: Cluster, before: dict[str, int], nodes: list[str]) -> int:
    """Steps run again (in place) by `nodes` since `before`: a failed step is run again by
    every replica, so the most any one of them failed, not the sum."""
    now = c.failed_steps()
    return max((max(0, now.get(n, 0) - before.get(n, 0)) for n in nodes), default=0)


def _ft_replays(res: Result, c: Cluster, failed0: dict[str, int], pids0: dict[str, int],
                nodes: list[str], head_lost: int | None) -> list[str]:
    """torchft: steps_replayed from the replicas' own reports only (their failed-step
    counts); the head's figure is kept in detail as a cross-check. Returns the nodes whose
    replica process changed (restarted: its count began again at 0, so the count above
    cannot see what it replayed, and the row does not pass)."""
    res.steps_replayed = _replayed_on_torchft(c, failed0, nodes)
    now = c.worker_pids()
    restarted = sorted(n for n in nodes if n in pids0 and now.get(n) != pids0[n])
    res.detail.update(head_lost_steps=head_lost, restarted_replicas=restarted)
    return restarted


def disk_full(root: Path, engine: str = "torchrun") -> Result:
    res = Result("13 checkpoint disk full")
    mnt = root / "ckpt-tmpfs"
    err = _mount_tmpfs(mnt, "8m")
    if err:
        res.blocked = f"cannot mount a tmpfs ({err}); not simulated"
        return res
    c = Cluster(
        root / "disk", "disk", "1", EVERY, extra_toml=f'checkpoint_dir = "{mnt}"\nkeep_last = 3',
        engine=engine,
    )
    c.checkpoint_dir = mnt
    try:
        c.up()
        c.wait_for(
            "2 committed checkpoints", lambda s: s["last_checkpoint_step"] >= 2 * EVERY, timeout=240
        )
        time.sleep(0.3)
        _fill(mnt)
        t0 = time.time()
        kept = c.committed()
        before = _snapshot(mnt, kept)
        n_rescales = len(c.events("rescale"))
        failed0 = c.failed_steps()
        pids0 = c.worker_pids()
        window = c.replay_window()
        st0 = c.status()
        # three checkpoint intervals with no room at all
        st = c.wait_for(
            "training to go on with a full disk",
            lambda s: s["step"] >= st0["step"] + 3 * EVERY,
            timeout=120,
        )
        during = c.committed()
        new_during = [s for s in during if s > max(kept)]
        after = _snapshot(mnt, [s for s in kept if s in during])
        intact = all(after[s] == before[s] for s in after) and bool(after)
        alive = bool(c.processes()) and st["world_size"] == 1
        log = "".join(
            p.read_text(errors="replace") for p in c.cluster_dir.glob("nodes/*/torchrun.log")
        )
        save_failed_logged = (
            "No space left" in log or "save" in log.lower() and "fail" in log.lower()
        )
        # space back: saving resumes
        for f in ("filler", "filler2"):
            (mnt / f).unlink(missing_ok=True)
        st1 = c.wait_for(
            "a checkpoint after space came back",
            lambda s: s["last_checkpoint_step"] > st["step"],
            timeout=120,
        )
        res.recover_s = round(time.time() - t0, 1)
        res.committed_steps_lost = 0 if intact else len(kept) - len(after)
        # replays while the disk was full and after (none expected), from the workers' own
        # records: their sample trace on torchrun, the replicas' reports on torchft
        head_lost = sum(int(e.get("lost_steps") or 0) for e in c.events("rescale")[n_rescales:])
        restarted: list[str] = []
        if engine == "torchft":
            restarted = _ft_replays(res, c, failed0, pids0, ["n1"], head_lost)
        else:
            replays.fill(res, window, head_lost)
        res.survived = (intact and alive and not new_during and st1["world_size"] == 1
                        and not restarted)
        res.detail.update({
            "committed_before": kept,
            "committed_while_full": during,
            "new_commits_while_full": new_during,
            "old_intact": intact,
            "save_failure_in_log": save_failed_logged,
            "steps_while_full": st["step"] - st0["step"],
            "checkpoint_after_space_back": st1["last_checkpoint_step"],
        })
        res.notes = (
            f"tmpfs 8 MiB filled; {st['step'] - st0['step']} steps trained while full; "
            f"old checkpoints intact: {intact}; saves resumed at "
            f"{st1['last_checkpoint_step']}"
        )
    except Exception as e:
        res.notes = f"{type(e).__name__}: {str(e)[:300]}"
        res.detail["error"] = str(e)[-4000:]
    finally:
        res.leaks += c.down()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    return res


def network_cut(root: Path, engine: str = "torchrun") -> Result:
    """14: nodes in network namespaces of the run's own (`[local] netns = true`); one
    node's link is taken down. The survivors must not hang: the head declares the silent
    node unresponsive after 4 s, their workers re-form without it."""
    res = Result("14 node cut off from the network")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        res.blocked = "network namespaces need root and iproute2"
        return res
    c = Cluster(root / "net", "net", "2..3", EVERY, extra_toml="\n[local]\nnetns = true",
                engine=engine)
    try:
        c.up()
        c.training(3, past=EVERY)
        from spotctl.providers.base import ProviderContext
        from spotctl.providers.local.provider import LocalProvider
        from spotctl.spec import ClusterSpec
        from spotctl.state import Store

        store = Store(c.home)
        spec = ClusterSpec.model_validate(store.get_cluster("net").spec)
        prov = LocalProvider(ProviderContext("net", spec, store.cluster_dir("net")))
        t0 = time.time()
        committed = c.committed_before(t0)
        failed0 = c.failed_steps()
        pids0 = c.worker_pids()
        window = c.replay_window()
        prov.isolate("n3")
        st = c.training(2, past=0, timeout=180)
        res.recover_s = round(time.time() - t0, 1)
        # the failure rescale (on torchft the start-up quorum's joins are rescales too)
        deadline = time.monotonic() + 30
        while not (rs := [e for e in c.events("rescale")
                          if e["ts"] >= t0 and e["reason"] == "failure"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no failure rescale: {c.events('rescale')}")
            time.sleep(0.5)
        r = rs[0]
        restarted: list[str] = []
        if engine == "torchft":
            st = c.training(2, past=st["step"] + 2, timeout=60)  # the survivors' counts settled
            # the survivors went on in place: counted from their own reports
            restarted = _ft_replays(res, c, failed0, pids0, ["n1", "n2"],
                                    int(r.get("lost_steps") or 0))
        else:
            replays.fill(res, window, int(r["lost_steps"]))
        res.committed_steps_lost = max(0, committed - int(r["resume_step"]))
        unresp = c.node_events("node-unresponsive", "n3")
        res.survived = bool(unresp) and st["world_size"] == 2 and not restarted
        res.notes = (f"n3's link down; unresponsive after {unresp[0]['silent_s'] if unresp else '?'}"
                     f" s; survivors re-formed at world 2 from step {r['resume_step']}")
        res.detail.update(rescale=r)
    except Exception as e:
        res.notes = f"{type(e).__name__}: {str(e)[:300]}"
        res.detail["error"] = str(e)[-4000:]
    finally:
        res.leaks += c.down()
        if (c.home / "state.db").exists():
            from spotctl.providers.local.net import ClusterNet

            res.leaks += ClusterNet.for_dir(c.cluster_dir).leftovers()
    return res


def can_mount() -> bool:
    return os.geteuid() == 0
