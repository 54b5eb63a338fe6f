"""`scripts/chaos`: run the fault matrix, print the table (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from .result import Result, table, unmeasured


def run_all(
    root: Path, only: set[str] | None = None, log=print, engine: str = "torchrun"
) -> list[Result]:
    from . import cloud, disk, local

    rows: list[Result] = []
    cluster_keys = {"1", "2", "3", "4", "5", "6", "7", "8", "11", "12", "15", "16", "17",
                    "18", "19"}
    if not only or only & cluster_keys:  # one shared 3-node cluster on the engine asked for
        if engine == "torchft":
            from . import ft

            rows += ft.run_ft_cluster_scenarios(root, only & cluster_keys if only else None, log)
        else:
            rows += local.run_cluster_scenarios(root, only & cluster_keys if only else None, log)
    # 9, 13 and 14 have a cluster of their own, on the engine asked for; 10 has no job
    if not only or "9" in only:
        rows.append(cloud.capacity_everywhere(root, engine))
        log(f"{rows[-1].scenario}: survived={rows[-1].survived} {rows[-1].notes}")
    if not only or "10" in only:
        rows.append(cloud.throttling())
    if not only or "13" in only:
        rows.append(disk.disk_full(root, engine))
        log(f"{rows[-1].scenario}: survived={rows[-1].survived} {rows[-1].notes}")
    if not only or "14" in only:
        rows.append(disk.network_cut(root, engine))
        log(f"{rows[-1].scenario}: survived={rows[-1].survived} {rows[-1].notes}")
    rows.sort(key=_order)
    return rows


def _order(r: Result) -> int:
    return int(r.scenario.split()[0]) if r.scenario.split()[0].isdigit() else 99


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__)
    ap.add_argument("--json", action="store_true", help='print {"scenarios": [...]}')
    ap.add_argument("--only", default="", help="comma-separated scenario numbers")
    ap.add_argument("--dir", default="", help="work dir (default: a temporary one)")
    from spotctl.spec import DEFAULT_ENGINE, ENGINES

    ap.add_argument("--engine", choices=ENGINES, default=DEFAULT_ENGINE,
                    help=f"the cluster scenarios' [train] engine (default {DEFAULT_ENGINE}, "
                         "the spec's)")
    a = ap.parse_args(argv)
    only = {x.strip() for x in a.only.split(",") if x.strip()} or None
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        rows = run_all(Path(a.dir or tmp), only, log, a.engine)
    if a.json:
        print(json.dumps({"scenarios": [r.to_json() for r in rows]}, indent=2, default=str))
    else:
        print(table(rows))
    bad = [
        r
        for r in rows
        if not r.blocked
        and (not r.survived or r.leaks or r.committed_steps_lost or unmeasured(r))
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
