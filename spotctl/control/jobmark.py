"""Which job a cluster's checkpoints belong to, so that a reused name never resumes
another job's checkpoints (the worker's own check, spotctl.elastic's ResumeMismatch, would
only crash it, again and again).

At `up`, for checkpoints the controller can read (the local provider's), it compares the
job recorded beside the cluster (`job.json` in the cluster's directory: the controller's
own file, never one the workers write) with this run's: a different training script with
committed checkpoints in the same directory is refused before anything starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

from spotctl.errors import SpecError
from spotctl.spec import ClusterSpec
from spotctl.state import ClusterDir, write_json_atomic

JOB_FILE = "job.json"
_STEP = re.compile(r"step-(\d+)")


def checkpoint_dir(spec: ClusterSpec, cdir: ClusterDir) -> Path | None:
    """Where the cluster's checkpoints are, when this machine can read them (local)."""
    if spec.provider != "local":
        return None
    cd = spec.train.checkpoint_dir
    return Path(cd) if cd else cdir.checkpoints


def committed_step(root: Path) -> int | None:
    """The newest committed checkpoint step under `root` (None: none)."""
    steps = [int(m[1]) for p in root.glob("step-*/COMMIT")
             if (m := _STEP.fullmatch(p.parent.name))] if root.is_dir() else []
    return max(steps) if steps else None


def check(spec: ClusterSpec, cdir: ClusterDir) -> None:
    """Refuse (one line, exit 2) to start `spec` on checkpoints another script wrote."""
    root = checkpoint_dir(spec, cdir)
    if root is None:
        return
    mark = cdir.path / JOB_FILE
    try:
        old = json.loads(mark.read_text())
    except (OSError, ValueError):
        old = None
    step = committed_step(root)
    if (isinstance(old, dict) and step is not None and old.get("checkpoint_dir") == str(root)
            and old.get("script") != spec.train.script):
        raise SpecError(
            f"cluster {spec.name} has checkpoints (step {step}) in {root} from another job "
            f"({old.get('script')}), not this one's {spec.train.script}: "
            f"`spotctl down --purge --name {spec.name}` deletes them, or give this project "
            "a name of its own (`name` in spotctl.toml)")


def mark(spec: ClusterSpec, cdir: ClusterDir) -> None:
    """Record this run's job beside the cluster (once `up` has started it)."""
    root = checkpoint_dir(spec, cdir)
    if root is None:
        return
    cdir.ensure()
    write_json_atomic(cdir.path / JOB_FILE, {"script": spec.train.script, "checkpoint_dir": str(root)},
                      mode=0o600)
