"""Sweep the DiLoCo row of `scripts/bench zones` over sync settings (issue 61): the same
model, task, samples and namespaces (2 zones x 2 groups, the link model) as the bench's
DiLoCo row, each setting run REPEAT times, one JSON line per run on stdout.

    sudo .venv/bin/python scripts/bench_lib/zones_sweep.py [--repeat 2] [--short] \
        diloco:20:0.7:0.5 localsgd:10 diloco:10:0.7:0.9 ...

A setting is sync:sync_every[:outer_lr[:outer_momentum]] (localsgd ignores the outer
keys). The DDP reference's loss is the bench's (`scripts/bench zones`): DDP's loss does not
depend on where its groups are."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_lib import zones  # noqa: E402
from bench_lib.core import REPO  # noqa: E402


def parse(text: str) -> dict:
    parts = text.split(":")
    train: dict = {"engine": "torchft", "sync": parts[0], "sync_every": int(parts[1])}
    if len(parts) > 2:
        train["outer_lr"] = float(parts[2])
    if len(parts) > 3:
        train["outer_momentum"] = float(parts[3])
    return train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("settings", nargs="+")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--short", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from spotctl.providers.local.net import ClusterNet, Link

    # SIGTERM: the groups' process trees and the namespaces are removed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    trains = [parse(s) for s in args.settings]
    size = zones.SHORT if args.short else zones.FULL
    inside, between, said = zones._links()
    print(json.dumps({"links": said, "size": size.__dict__}), flush=True)
    work = Path(tempfile.mkdtemp(prefix="spotctl-zsweep-"))
    net = ClusterNet.for_dir(work)
    ids = [1, 2, 3, 4]
    try:
        net.ensure_bridge()
        for i in ids:
            net.add_node(i)
        net.shape_zones(dict(zip(ids, ("za", "za", "zb", "zb"), strict=True)),
                        Link.parse(inside), Link.parse(between))
        for rep in range(args.repeat):  # interleaved: each setting once per round
            for k, (text, train) in enumerate(zip(args.settings, trains, strict=True)):
                load = os.getloadavg()[0]
                sub = work / f"{k}-{rep}"
                sub.mkdir()
                res = zones._run_diloco(net, ids, sub, size, train)
                res.update(setting=text, round=rep + 1,
                           load=round(max(load, os.getloadavg()[0]), 1))
                print(json.dumps(res), flush=True)
    finally:
        for i in ids:
            net.remove_node(i)
        net.remove_bridge()


if __name__ == "__main__":
    main()
