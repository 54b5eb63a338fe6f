"""Which checkpoint to resume from, per framework: no framework imported."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

_HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_STEP = re.compile(r"step=(\d+)")


def latest_hf_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete ``checkpoint-N`` under ``output_dir``, or None to start fresh.

    Complete: its ``trainer_state.json`` (the trainer writes it last) parses and names step
    N. A directory cut short by a kill is passed over for the one before it.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = []
    for p in root.iterdir():
        m = _HF_CHECKPOINT.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    for step, p in sorted(found, reverse=True):
        try:
            state = json.loads((p / "trainer_state.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and state.get("global_step") == step:
            return str(p)
    return None


def latest_zip_checkpoint(dirpath: str | Path) -> str | None:
    """The newest whole ``*.ckpt`` under ``dirpath`` by the ``step=N`` in its name (the
    notice checkpoints and ModelCheckpoint's default names), or None to start fresh. A
    file cut short by a kill is no whole zip archive and is passed over."""
    root = Path(dirpath)
    if not root.is_dir():
        return None
    found = []
    for p in root.glob("*.ckpt"):
        m = _STEP.search(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p.stat().st_mtime, p))
    for _step, _mtime, p in sorted(found, reverse=True):
        if zipfile.is_zipfile(p):
            return str(p)
    return None
