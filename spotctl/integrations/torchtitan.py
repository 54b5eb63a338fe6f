"""torchtitan's fault tolerance (``--fault_tolerance.*``) from spotctl's worker environment.

Untested against torchtitan training: torchtitan 0.3.0 (released for torch 2.14.0) installs
and imports beside torch 2.13.0 and torchft 0.2.0 (with triton on the CPU build), but its
trainer picks the CUDA device whenever no other accelerator is found (``torch.cuda.
set_device`` fails on a CPU-only torch; forced onto the CPU, its memory monitor fails
next), so it cannot train on this project's CPU test machines. What is tested is the
mapping below, on real workers' environments through a replacement
(tests/e2e/test_rescale.py), and that torchtitan 0.3.0's own config parser accepts the
arguments (where torchtitan and triton are installed; CI installs neither).

Under the torchft engine spotctl starts one torchrun per replica group with
``TORCHFT_LIGHTHOUSE`` (torchft's Manager reads it itself; torchtitan has no flag for it),
``SPOTCTL_FT_REPLICA_INDEX`` (the group's dense index: the head gives each group the
lowest free one when it joins, and a replacement reuses a gone group's) and
``SPOTCTL_MAX_WORLD`` set. torchtitan wants an integer replica id in ``[0, group_size)``
(it also picks the replica's data shard) and ``group_size``, the most replica groups the
job can have::

    torchrun ... -m torchtitan.train --module torchft.llama3 --config ... \\
        $(python -m spotctl.integrations.torchtitan)
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

__all__ = ["AdapterError", "fault_tolerance_args"]


class AdapterError(ValueError):
    """spotctl's environment does not give torchtitan what it needs."""


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "")
    try:
        v = int(raw)
    except ValueError:
        raise AdapterError(f"{name}={raw!r} is not an integer (spotctl sets it for every "
                           "worker; is this running under spotctl's torchft engine?)") from None
    if v < 1:
        raise AdapterError(f"{name}={v} must be at least 1")
    return v


def fault_tolerance_args(env: Mapping[str, str] | None = None) -> list[str]:
    """The ``--fault_tolerance.*`` arguments for this replica group.

    ``group_size`` is the cluster's largest world over this group's world (the most
    groups that can run at once); ``replica_id`` is ``SPOTCTL_FT_REPLICA_INDEX`` (spotctl's
    agent sets it), else (a head older than the index) the number at the end of
    ``SPOTCTL_FT_REPLICA_ID`` (``g0``, ``g1``, ...) when it is below ``group_size``.
    Raises AdapterError (one line)
    for anything else: two groups on one torchtitan replica id would share a torchft
    identity and a data shard.
    """
    e = os.environ if env is None else env
    if not e.get("TORCHFT_LIGHTHOUSE"):
        raise AdapterError("TORCHFT_LIGHTHOUSE is not set: run under spotctl with "
                           "[train] engine = \"torchft\"")
    world = _int(e, "WORLD_SIZE")
    max_world = _int(e, "SPOTCTL_MAX_WORLD")
    if max_world % world:
        raise AdapterError(f"SPOTCTL_MAX_WORLD={max_world} is not a multiple of this replica "
                           f"group's WORLD_SIZE={world}")
    group_size = max_world // world
    if e.get("SPOTCTL_FT_REPLICA_INDEX"):
        index = int(e["SPOTCTL_FT_REPLICA_INDEX"]) if e["SPOTCTL_FT_REPLICA_INDEX"].isdigit() \
            else -1
        source = f"SPOTCTL_FT_REPLICA_INDEX={e['SPOTCTL_FT_REPLICA_INDEX']!r}"
    else:
        rid = e.get("SPOTCTL_FT_REPLICA_ID", "")
        m = re.fullmatch(r"[A-Za-z_-]*(\d+)", rid)
        index = int(m.group(1)) if m else -1
        source = f"SPOTCTL_FT_REPLICA_ID={rid!r}"
    if not 0 <= index < group_size:
        raise AdapterError(f"{source} gives no replica index in [0, {group_size}) "
                           f"(group_size = SPOTCTL_MAX_WORLD {max_world} / WORLD_SIZE {world})")
    return ["--fault_tolerance.enable", f"--fault_tolerance.replica_id={index}",
            f"--fault_tolerance.group_size={group_size}"]


def main() -> int:
    try:
        print(" ".join(fault_tolerance_args()))
    except AdapterError as err:
        print(f"spotctl: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
