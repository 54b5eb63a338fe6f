"""The root agent creates files in the training user's status directory (the rendezvous
gate, the leaving flag, the next round's size) with runas.touch. The training user can put
anything there first. Tried as that user: a FIFO (a write-only open waits for a reader,
forever), a symlink to a root file, and a hard-linkable regular file with content."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spotctl.agent import runas


def _touch_in_child(path: Path) -> subprocess.CompletedProcess[str]:
    # a child, so that a touch that blocks is killed by the timeout instead of the test run
    return subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from spotctl.agent import runas; runas.touch(Path(sys.argv[1]))", str(path)],
        capture_output=True, text=True, timeout=20)


def test_a_fifo_in_place_of_the_gate_fails_at_once(tmp_path: Path) -> None:
    gate = tmp_path / "rdzv-gate.round-3-2"
    os.mkfifo(gate)
    r = _touch_in_child(gate)  # before: blocked until killed
    assert r.returncode != 0 and "OSError" in r.stderr, r


def test_a_link_is_not_followed_and_content_not_truncated(tmp_path: Path) -> None:
    target = tmp_path / "root-file"
    target.write_text("keep")
    link = tmp_path / "rdzv-gate"
    link.symlink_to(target)
    with pytest.raises(OSError):
        runas.touch(link)
    planted = tmp_path / "rdzv-gate.leaving"
    planted.write_text("keep")
    runas.touch(planted)
    assert target.read_text() == "keep" and planted.read_text() == "keep"
