"""Network: all-reduce bus bandwidth between the nodes of a cluster (issue 33).

train_network.py (nccl-tests style: per message size, the slowest rank's mean time of a
few all-reduces; busbw = bytes / time * 2(n-1)/n) runs twice on this machine:
- spotctl: as the training script of a local cluster of one 1-GPU node per rank
  (`spotctl up`, engine torchrun, whose world spans the nodes), so the figure is what the
  cluster's nodes get between them (here: loopback between process trees, gloo);
- baseline: the same ranks under plain torchrun (`--standalone`, one host).
On a cloud cluster the same script, as the cluster's train.py, measures the fabric the
nodes got (EFA, gVNIC), on NCCL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .core import LIB, Context, Row, row
from .spotctl_session import NO_HEAD_LOOP, Cluster

SIZES = (1 << 20, 16 << 20)  # 1 MiB, 16 MiB


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _env(out: Path, sizes: tuple[int, ...], iters: int) -> dict[str, str]:
    return {"NETBENCH_OUT": str(out), "NETBENCH_SIZES": ",".join(map(str, sizes)),
            "NETBENCH_ITERS": str(iters), "OMP_NUM_THREADS": "1"}


def plain(work: Path, ranks: int, sizes: tuple[int, ...], iters: int) -> dict:
    out = work / "net.json"
    env = dict(os.environ, **_env(out, sizes, iters))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={ranks}", str(LIB / "train_network.py")],
                       env=env, cwd=work, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"plain torchrun exited {p.returncode}: {p.stderr.strip()[-800:]}")
    return json.loads(out.read_text())


def on_spotctl(work: Path, ranks: int, sizes: tuple[int, ...], iters: int) -> dict:
    c = Cluster(work, ranks, first_every=1_000_000)
    out = work / "net.json"
    (c.project / "train.py").write_text((LIB / "train_network.py").read_text())
    env_toml = ", ".join(f'{k} = "{v}"' for k, v in _env(out, sizes, iters).items())
    (c.project / "spotctl.toml").write_text(
        f'name = "{c.name}"\nprovider = "local"\ngpus = "{ranks}"\n\n'
        f'[train]\nengine = "torchrun"\nscript = "train.py"\nenv = {{ {env_toml} }}\n'
        + NO_HEAD_LOOP)
    try:
        c.cli("up", "--wait", "180", timeout=300)
        deadline = time.monotonic() + 600
        while not out.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's all-reduce test wrote no result in 600 s")
            time.sleep(0.5)
    finally:
        c.down()
    return json.loads(out.read_text())


def bench(ctx: Context, ranks: int = 2, sizes: tuple[int, ...] = SIZES,
          iters: int = 5) -> list[Row]:
    reps = ctx.reps(2)
    ours: dict[int, list[float]] = {s: [] for s in sizes}
    base: dict[int, list[float]] = {s: [] for s in sizes}
    backend = ""
    for i in range(reps):
        for name, dest in (("plain", base), ("spotctl", ours)):
            d = ctx.subdir(f"network-{name}-{i}")
            res = (plain(d, ranks, sizes, iters) if name == "plain"
                   else on_spotctl(d, ranks, sizes, iters))
            backend = backend or str(res["backend"])
            if res["world"] != ranks:
                raise RuntimeError(f"{name}: world {res['world']}, expected {ranks}")
            for r in res["rows"]:
                dest[int(r["bytes"])].append(float(r["busbw_gbs"]))
            ctx.log(f"network {name} run {i + 1}: " + ", ".join(
                f"{size_label(r['bytes'])} {r['busbw_gbs']:.3f} GB/s" for r in res["rows"]))
    note = (f"{ranks} ranks ({backend}), all-reduce busbw = bytes/time * 2(n-1)/n, slowest "
            f"rank's mean of {iters} after 2 warm-up; spotctl: between a local cluster's "
            "nodes; baseline: plain torchrun on one host")
    return [row("network", f"all-reduce bus bandwidth, {size_label(s)}", ours[s], base[s],
                "GB/s", note) for s in sizes]
