"""scripts/gpu-check: without CUDA it skips every check cleanly (exit 0, one SKIP line per
check); and the checks whose logic does not need a GPU (the DCP saves through the pinned /
overlapping stager) run here on CPU through the script's own worker path, as does ft-nccl's
scenario with gloo in place of NCCL, so a broken check is found before a GPU machine is
paid for."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"


def _checks() -> list[str]:
    return list(runpy.run_path(str(SCRIPT), run_name="gpu_check")["CHECKS"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real checks")
def test_without_cuda_every_check_is_skipped_and_the_exit_is_0() -> None:
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == [f"SKIP {c}" for c in _checks()], p.stdout
    assert "Traceback" not in p.stderr


@pytest.mark.slow  # two DCP saves in fresh processes
@pytest.mark.parametrize("check", ["dcp-pinned", "dcp-overlap"])
def test_cpu_capable_checks_pass_through_the_worker_path(check: str, tmp_path: Path) -> None:
    out = tmp_path / check
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # one rank: the kernel picks
    p = subprocess.run([sys.executable, str(SCRIPT), "--worker", check, str(out)], env=env,
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(Path(f"{out}.r0").read_text())
    assert res["ok"], (res, p.stderr[-3000:])  # what the worker logged: why it failed


@pytest.mark.slow  # two replica groups in fresh processes, a join, a leave
def test_ft_nccl_check_logic_passes_on_cpu_with_gloo(tmp_path: Path) -> None:
    """ft-nccl's scenario with gloo instead of NCCL: the second replica group heals from the
    first, they train with equal parameters, the first leaves, the second goes on."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (the 'ft' extra)")
    check = runpy.run_path(str(SCRIPT), run_name="gpu_check")
    ok, detail = check["ft_check"](str(tmp_path), cuda=False)
    assert ok, detail
    assert detail.startswith("torchft-gloo on {'cpu'} (CPU): joiner healed"), detail


def test_a_failed_ft_check_says_what_the_workers_said(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A FAIL names the workers' own last errors (the H200's ft-nccl FAIL said only its
    exit codes): here both groups' workers stop at a bad setting."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (the 'ft' extra)")
    monkeypatch.setenv("SPOTCTL_FT_TIMEOUT_S", "soon")
    check = runpy.run_path(str(SCRIPT), run_name="gpu_check")
    ok, detail = check["ft_check"](str(tmp_path), cuda=False)
    assert not ok and detail.startswith("exit codes [1, 1], steps logged 0 and 0; g0 said: ")
    assert detail.count("could not convert string to float: 'soon'") == 2, detail


@pytest.mark.slow  # two replica groups in fresh processes, a join, one frozen
def test_ft_vanish_check_logic_passes_on_cpu_with_gloo(tmp_path: Path) -> None:
    """ft-vanish with gloo: the first replica group freezes mid-step (SIGSTOP) with a
    cross-replica timeout of 16 s; the second gives the step up on its stale heartbeats
    (2 s stale: 2.4 s measured in tests/e2e/test_ft_vanished.py) and trains on alone,
    well before that timeout would have ended the step."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (the 'ft' extra)")
    check = runpy.run_path(str(SCRIPT), run_name="gpu_check")
    ok, detail = check["ft_check"](str(tmp_path), cuda=False, vanish=True)
    assert ok, detail
    waited = float(detail.rsplit("waited ", 1)[1].split(" s")[0])
    assert waited < 12, detail  # the timeout (16 s) would show as >= 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real checks")
def test_require_makes_a_machine_without_cuda_fail() -> None:
    """On the GPU machine the checks run with --require: a check that cannot run fails."""
    p = subprocess.run([sys.executable, str(SCRIPT), "--require"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert [ln.split(":")[0] for ln in p.stdout.splitlines()] == [
        f"FAIL {c}" for c in _checks()], p.stdout


@pytest.mark.slow  # a zygote (torch imported) and a worker forked from it
def test_zygote_check_forks_its_workers_from_a_real_zygote(tmp_path: Path) -> None:
    """The zygote check's plumbing on CPU: the worker is forked by a real zygote (the
    device check itself then fails here: it wants CUDA), not started cold."""
    run_check = runpy.run_path(str(SCRIPT), run_name="gpu_check")["run_check"]
    ok, detail = run_check("zygote", 1, str(tmp_path))
    assert not ok  # no GPU here
    assert not detail.startswith(("not forked by the zygote", "the zygote did not start",
                                  "rank 0 wrote no result")), detail


@pytest.mark.parametrize("require", [False, True])
def test_a_dependency_that_cannot_be_imported_is_one_line_per_check(
    tmp_path: Path, require: bool
) -> None:
    """A node image without one of spotctl's dependencies (the H200 image lacked hpack):
    one line per check naming the module, no traceback; a FAIL under --require."""
    (tmp_path / "hpack.py").write_text("raise ImportError('hpack is not installed here')\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(SCRIPT), *(["--require"] if require else [])],
                       capture_output=True, text=True, timeout=120, env=env)
    word = "FAIL" if require else "SKIP"
    assert p.returncode == (1 if require else 0), (p.stdout, p.stderr)
    assert p.stdout.splitlines() == [
        f"{word} {c}: spotctl cannot be imported here: hpack: ImportError: hpack is not "
        "installed here" for c in _checks()], p.stdout
    assert "Traceback" not in p.stderr
