"""The pieces every integration shares, without a framework: the notice file as the
contract writes it, the global batch arithmetic, and the saved signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotctl.integrations import _notice
from spotctl.integrations._common import GlobalBatchError, accumulation_steps


def test_notice_reads_the_contract_and_nothing_else(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "notice"
    monkeypatch.delenv(_notice.ENV, raising=False)
    assert _notice.notice() is None
    monkeypatch.setenv(_notice.ENV, str(f))
    assert _notice.notice() is None  # no file: no notice
    for bad in ['{"reason": "notice"', "[]", '{"reason": "reboot", "deadline": 1}',
                '{"reason": "notice", "deadline": "soon"}', '{"reason": "notice"}',
                '{"reason": "notice", "deadline": true}', "x" * 5000]:
        f.write_text(bad)
        assert _notice.notice() is None, bad
    f.write_text(json.dumps({"reason": "rescale", "deadline": 123, "id": "n1"}))
    assert _notice.notice() == {"reason": "rescale", "deadline": 123.0, "id": "n1"}


@pytest.mark.parametrize(("g", "b", "w", "want"), [(64, 4, 1, 16), (64, 4, 2, 8),
                                                     (64, 4, 16, 1), (6, 1, 3, 2)])
def test_accumulation_keeps_the_global_batch(g: int, b: int, w: int, want: int) -> None:
    assert accumulation_steps(g, b, w) == want
    assert want * b * w == g


@pytest.mark.parametrize(("g", "b", "w"), [(64, 4, 3), (64, 3, 1), (8, 4, 4), (0, 1, 1),
                                           (8, -2, 1)])
def test_accumulation_refuses_a_batch_it_cannot_keep(g: int, b: int, w: int) -> None:
    with pytest.raises(GlobalBatchError) as e:
        accumulation_steps(g, b, w)
    assert "\n" not in str(e.value) and str(g) in str(e.value)


def test_accumulation_reads_torchrun_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert accumulation_steps(32, 2) == 4


def test_saved_worker_waits_for_sigterm_and_never_exits_zero(tmp_path: Path) -> None:
    """notice_saved writes the rank's saved record and blocks; SIGTERM ends it by signal
    even where the process had its own SIGTERM handler (Lightning installs one)."""
    f = tmp_path / "notice"
    f.write_text(json.dumps({"reason": "notice", "deadline": time.time() + 60, "id": "n7"}))
    code = ("import signal; signal.signal(signal.SIGTERM, lambda *a: None)\n"
            "from spotctl.integrations import _notice; _notice.notice_saved(17)\n")
    env = dict(os.environ, SPOTCTL_NOTICE_FILE=str(f), RANK="3")
    p = subprocess.Popen([sys.executable, "-c", code], env=env)
    saved = Path(f"{f}.saved.3")
    try:
        end = time.monotonic() + 60
        while not saved.exists() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        rec = json.loads(saved.read_text())
        assert (rec["step"], rec["rank"], rec["id"]) == (17, 3, "n7")
        assert p.poll() is None  # still waiting: it did not return into the script
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
