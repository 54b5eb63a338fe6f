"""A worker's C heap keeps the memory a training step frees (spotctl.elastic.
keep_freed_memory, set by elastic.init()): with glibc's defaults, the tensors a CPU step
allocates and frees every step (an optimizer's temporaries, gradients) are, whenever the
heap's top is free, handed back to the kernel and faulted in again, zeroed, at the next
step: 16-20 thousand page faults and ~50 ms of kernel time per step of scripts/bench
overhead's MLP (issue 58). Counted from the kernel's own minor-fault counter of a real
worker process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spotctl import elastic

pytestmark = pytest.mark.timeout(120)

# a step of the overhead benchmark's kind, smaller: 4 x 2048 linear layers (16 MiB of
# weights each), AdamW; the minor faults of each step, after elastic.init()
_WORKER = """
import resource, torch
from spotctl import elastic
elastic.init()
torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])
opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
x = torch.randn(64, 2048)
out = []
for i in range(12):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    opt.zero_grad()
    m(x).square().mean().backward()
    opt.step()
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(elastic.keep_freed_memory(), *out)
"""


def _faults(tmp_path, **env: str) -> tuple[bool, list[int]]:
    script = tmp_path / "w.py"
    script.write_text(_WORKER)
    e = {k: v for k, v in os.environ.items()
         if k not in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES",
                      "SPOTCTL_MALLOC_KEEP")}
    e.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
             MASTER_PORT="0", OMP_NUM_THREADS="1", **env)
    p = subprocess.run([sys.executable, str(script)], env=e, capture_output=True, text=True,
                       timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    kept, *steps = p.stdout.splitlines()[-1].split()
    return kept == "True", [int(s) for s in steps]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_worker_does_not_fault_its_steps_memory_in_again(tmp_path):
    kept, steps = _faults(tmp_path)
    assert kept
    # after the first steps (the optimizer's state is made, the heap grows to its size),
    # a step faults in next to nothing: one 16 MiB temporary given back and taken again
    # would be 4096 faults, and glibc's defaults here fault in 90 to 440 thousand pages
    # over these 8 steps (measured with SPOTCTL_MALLOC_KEEP=0; 12-50 thousand a step)
    assert sum(steps[4:]) < 4 * 4096, steps


def test_left_alone_when_asked_or_when_the_user_tuned_malloc(monkeypatch):
    """Checked in this process: each case returns before any mallopt()."""
    for env in ({"SPOTCTL_MALLOC_KEEP": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                {"MALLOC_MMAP_THRESHOLD_": "131072"},
                {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}):
        with monkeypatch.context() as m:
            for k in ("SPOTCTL_MALLOC_KEEP", "MALLOC_TRIM_THRESHOLD_",
                      "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
                m.delenv(k, raising=False)
            for k, v in env.items():
                m.setenv(k, v)
            m.setattr(elastic, "_malloc_kept", None)
            assert elastic.keep_freed_memory() is False, env
