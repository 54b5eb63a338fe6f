"""Zones (issue 61): one job's replica groups across two emulated zones, on one machine.

Each replica group is one rank in a network namespace of its own (spotctl's local
provider's netns mode, spotctl.providers.local.net), the namespaces grouped into zones
with the link model of `[local] link_in_zone` / `link_between_zones` (HTB rates, and
`tc netem` delays where the kernel has netem; where it has not, rates only, said in every
row). The same model (train_zones.py: torch DDP over gloo) trains the same samples in
each setting, in interleaved rounds:

- DDP across zones: 2 zones x 2 groups, the per-step all-reduce crossing zones;
- DDP in one zone, the same 4 groups (the reference the issue's goal names: "the same
  GPUs in one zone");
- DDP in one zone, half the groups (what a job kept in one dry zone would have);
- DiLoCo across zones ([train] sync = "diloco"): only where the build has it.

Figures: step time (median after two warm-up steps, rank 0), samples/s (global batch /
step time), held-out loss after the same samples. Each row's note names the machine's
1-minute load average during its runs. Goal (issue 61): DiLoCo across zones >= 0.9 of the
samples/s of the same groups in one zone, its loss within 2 % of DDP's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .core import LIB, REPO, Context, Row, row

if TYPE_CHECKING:
    from spotctl.providers.local.net import ClusterNet

INSIDE, BETWEEN = "1gbit 1ms", "100mbit 40ms"  # the example link model


@dataclass(frozen=True)
class Size:
    hidden: int  # the MLP's width: 2 hidden layers (hidden=1024: 1.1 M parameters)
    batch: int  # per group per step
    samples: int  # every setting trains this many
    rounds: int  # default repeats


FULL = Size(hidden=1024, batch=32, samples=4 * 32 * 40, rounds=3)
SHORT = Size(hidden=256, batch=32, samples=4 * 32 * 12, rounds=1)  # what the slow test runs


@dataclass
class Setting:
    key: str
    label: str
    zones: tuple[str, ...]  # one per group (rank order)
    results: list[dict] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)


def diloco_missing() -> str | None:
    """Why this build cannot run the DiLoCo row (None: it can)."""
    sys.path.insert(0, str(REPO))
    from spotctl.spec import TrainSpec

    if "sync" not in TrainSpec.model_fields:
        return "diloco: not available in this build"
    # the training side's [train] sync exists, but this benchmark does not drive it yet:
    # never a row of our own making in its place
    return "diloco: in this build, but scripts/bench zones does not drive it yet"


def _links() -> tuple[str, str, str]:
    """(inside, between, what the rows say about them)."""
    from spotctl.providers.local.net import netem_missing

    why = netem_missing()
    if why is None:
        return INSIDE, BETWEEN, f"links: {INSIDE} inside a zone, {BETWEEN} between"
    inside, between = INSIDE.split()[0], BETWEEN.split()[0]
    return inside, between, (f"links: {inside} inside a zone, {between} between, NO delays "
                             f"({why})")


def _run(net: ClusterNet, nodes: list[int], work: Path, size: Size, port: int) -> dict:
    out = work / "result.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, WORLD_SIZE=str(len(nodes)), MASTER_ADDR=net.node_ip(nodes[0]),
               MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
               ZB_HIDDEN=str(size.hidden), ZB_BATCH=str(size.batch),
               ZB_SAMPLES=str(size.samples), ZB_OUT=str(out))
    procs = []
    log = open(work / "train.log", "ab")
    try:
        for r, n in enumerate(nodes):
            procs.append(subprocess.Popen(
                [*net.exec_prefix(n), sys.executable, str(LIB / "train_zones.py")],
                env=dict(env, RANK=str(r)), stdout=log, stderr=subprocess.STDOUT, cwd=work))
        deadline = time.monotonic() + 600
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        log.close()
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad or not out.exists():
        tail = (work / "train.log").read_text(errors="replace")[-800:]
        raise RuntimeError(f"zones: a rank exited {bad}: {tail}")
    return json.loads(out.read_text())


def bench(ctx: Context, short: bool = False) -> list[Row]:
    sys.path.insert(0, str(REPO))
    from spotctl.providers.local.net import ClusterNet, Link
    from spotctl.sockets import spare_port

    size = SHORT if short else FULL
    reps = ctx.reps(size.rounds)
    inside, between, said = _links()
    settings = [
        Setting("across", "DDP across 2 zones (2 x 2 groups)", ("za", "za", "zb", "zb")),
        Setting("one", "DDP in one zone (the same 4 groups)", ("za",) * 4),
        Setting("half", "DDP in one zone (half: 2 groups)", ("za",) * 2),
    ]
    work = ctx.subdir("zones")
    net = ClusterNet.for_dir(work)
    nodes: dict[str, list[int]] = {}
    made: list[int] = []
    try:
        net.ensure_bridge()
        n = 0
        for st in settings:
            ids = list(range(n + 1, n + 1 + len(st.zones)))
            n += len(st.zones)
            for i in ids:
                net.add_node(i)
                made.append(i)
            net.shape_zones(dict(zip(ids, st.zones, strict=True)), Link.parse(inside),
                            Link.parse(between))
            nodes[st.key] = ids
        for i in range(reps):
            for st in settings:
                load = os.getloadavg()[0]
                res = _run(net, nodes[st.key], ctx.subdir(f"zones-{st.key}-{i}"), size,
                           spare_port())
                st.loads.append(max(load, os.getloadavg()[0]))
                st.results.append(res)
                ctx.log(f"zones {st.key} round {i + 1}: {res['samples_per_s']:.0f} samples/s, "
                        f"step {res['step_s'] * 1000:.0f} ms, loss {res['loss']:.4f} after "
                        f"{res['samples']} samples, load {st.loads[-1]:.1f}")
    finally:
        for i in made:
            net.remove_node(i)
        net.remove_bridge()
    ref = settings[1]
    params = ref.results[0]["params"]
    common = (f"{params:,}-parameter MLP, {size.samples} samples, {size.batch} per group per "
              f"step, torch DDP over gloo, one CPU rank per group; {said}; baseline: the same "
              "4 groups in one zone")

    def load(st: Setting) -> str:
        return f"load {min(st.loads):.1f}..{max(st.loads):.1f}"

    rows: list[Row] = []
    for st in settings:
        sps = [r["samples_per_s"] for r in st.results]
        ratio = (sorted(sps)[len(sps) // 2]
                 / sorted(r["samples_per_s"] for r in ref.results)[len(sps) // 2])
        rows.append(row("zones", f"samples/s, {st.label}", sps,
                        [r["samples_per_s"] for r in ref.results], "samples/s",
                        f"{ratio:.2f} x the baseline; {load(st)}; {common}"))
        rows.append(row("zones", f"step time, {st.label}",
                        [r["step_s"] * 1000 for r in st.results],
                        [r["step_s"] * 1000 for r in ref.results], "ms",
                        f"global batch {st.results[0]['global_batch']}; {load(st)}"))
        rows.append(row("zones", f"loss after {size.samples} samples, {st.label}",
                        [r["loss"] for r in st.results], [r["loss"] for r in ref.results],
                        "MSE", f"held-out; {load(st)}"))
    missing = diloco_missing()
    rows.append(row("zones", "samples/s, DiLoCo across 2 zones (2 x 2 groups)", [], [],
                    "samples/s", missing or ""))
    return rows
