"""The GPU gate: on a GPU instance type, training workers start only once the NVIDIA
driver answers and torch sees the type's GPUs.

Without it a node whose driver is still being installed (GCP installs it at first boot),
broken, or short of devices would train on CPU: spotctl.elastic falls back to gloo and
the job runs, slowly and silently. The gate waits a bounded time, then says why it gave up;
the agent reports that to the head and starts nothing, so the node is replaced.

Two probes, in order, each one subprocess:
- `nvidia-smi --query-gpu=name --format=csv,noheader`: one line per GPU; a non-zero exit
  (9: no driver, 6: no devices) or no executable means the driver is not there (yet);
- the workers' interpreter: `torch.cuda.device_count()`, with the workers' environment
  (CUDA_VISIBLE_DEVICES included); a CPU-only torch says 0 here even with a driver.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

QUERY = ["--query-gpu=name", "--format=csv,noheader"]
TORCH_PROBE = "import torch; print(torch.cuda.device_count())"
PROBE_TIMEOUT_S = 120.0  # a first CUDA init on a big node takes a while


@dataclass(frozen=True)
class GateResult:
    ok: bool
    reason: str  # why the gate stayed closed ("" when ok)
    driver_gpus: int | None  # GPUs nvidia-smi listed (None: it did not answer)
    torch_gpus: int | None  # GPUs torch saw (None: not asked or no answer)
    waited_s: float


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:200]
    return ""


def driver_gpus(env: Mapping[str, str], **popen: Any) -> tuple[int | None, str]:
    """GPUs the NVIDIA driver lists, or (None, why not)."""
    exe = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if exe is None:
        return None, "nvidia-smi is not installed (no NVIDIA driver on this node yet)"
    try:
        r = subprocess.run([exe, *QUERY], capture_output=True, text=True, env=dict(env),
                           timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL, **popen)
    except subprocess.TimeoutExpired:
        return None, f"nvidia-smi did not answer within {PROBE_TIMEOUT_S:.0f}s"
    except OSError as e:
        return None, f"nvidia-smi could not run: {e}"
    if r.returncode != 0:
        said = _first_line(r.stdout) or _first_line(r.stderr)
        return None, f"nvidia-smi exited {r.returncode}" + (f": {said}" if said else "")
    return sum(1 for line in r.stdout.splitlines() if line.strip()), ""


def torch_gpus(python: str, env: Mapping[str, str], **popen: Any) -> tuple[int | None, str]:
    """GPUs torch sees from the workers' interpreter, or (None, why not)."""
    try:
        r = subprocess.run([python, "-c", TORCH_PROBE], capture_output=True, text=True,
                           env=dict(env), timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL,
                           **popen)
    except subprocess.TimeoutExpired:
        return None, f"torch did not report its GPUs within {PROBE_TIMEOUT_S:.0f}s"
    except OSError as e:
        return None, f"{python} could not run: {e}"
    # a root agent reads this from a process run as the training user: a GPU count has at
    # most 4 decimal digits (int() of thousands of digits would raise in the agent)
    last = (r.stdout.strip().splitlines() or [""])[-1].strip()
    if r.returncode != 0 or not (last.isascii() and last.isdigit() and len(last) <= 4):
        err = (r.stderr.strip().splitlines() or [""])[-1].strip()[:200]
        return None, f"torch could not count GPUs ({python} exited {r.returncode}: {err})"
    return int(last), ""


def wait_for_gpus(
    expected: int,
    python: str,
    env: Mapping[str, str],
    wait_s: float,
    *,
    interval_s: float = 5.0,
    stop: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    popen: Mapping[str, Any] | None = None,
) -> GateResult:
    """Probe until the driver lists and torch sees `expected` GPUs, for at most `wait_s`
    (at least one probe). `expected` 0 (a CPU node) opens the gate at once. The probes
    run with `popen` (a root agent's: as the training user)."""
    kw = dict(popen or {})
    t0 = clock()
    if expected <= 0:
        return GateResult(True, "", None, None, 0.0)
    while True:
        n, why = driver_gpus(env, **kw)
        t = None
        if n is not None and n < expected:
            why = f"nvidia-smi lists {n} GPU(s), the instance type has {expected}"
        elif n is not None:
            t, why = torch_gpus(python, env, **kw)
            if t is not None and t < expected:
                why = (f"torch sees {t} of the instance type's {expected} GPU(s) (nvidia-smi "
                       f"lists {n}): a CPU-only torch, or CUDA_VISIBLE_DEVICES hides some")
            elif t is not None:
                return GateResult(True, "", n, t, clock() - t0)
        waited = clock() - t0
        if waited + interval_s > wait_s or stop():
            return GateResult(False, f"{why} (gave up after {waited:.0f}s)", n, t, waited)
        sleep(interval_s)
