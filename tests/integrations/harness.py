"""Drive the notice contract by hand around a real torchrun, as the agent would.

The worker side reads SPOTCTL_NOTICE_FILE (JSON: reason, deadline, id) and, once saved,
writes ``<notice file>.saved.<rank>``; the agent then sends SIGTERM (at the latest at the
deadline) and starts torchrun again at the new size. Here the test plays the agent: it
writes the notice, waits for every rank's saved file or the deadline, sends SIGTERM to
torchrun and restarts it with another --nproc-per-node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Job:
    """One torchrun launch of `script` (real torchrun, gloo on CPU)."""

    def __init__(self, tmp: Path, name: str, script: Path, nproc: int, args: list[str],
                 env: dict[str, str] | None = None) -> None:
        self.name, self.nproc = name, nproc
        self.notice_file = tmp / f"{name}.notice"
        self.out_path = tmp / f"{name}.out"
        e = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                 SPOTCTL_NOTICE_FILE=str(self.notice_file),
                 PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        e.update(env or {})
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                 f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={name}",
                 "--local-addr=127.0.0.1", str(script), *args],
                env=e, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=str(tmp))

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_for(self, what: str, pred: Callable[[], object], timeout: float = 180.0) -> None:
        end = time.monotonic() + timeout
        while not pred():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode} before "
                                     f"{what}:\n{self.output()[-4000:]}")
            if time.monotonic() > end:
                raise AssertionError(f"{self.name}: no {what} in {timeout:.0f} s:\n"
                                     + self.output()[-4000:])
            time.sleep(0.05)

    def notice(self, grace_s: float = 60.0) -> list[dict]:
        """Post a notice, wait until every rank saved (or the deadline), SIGTERM torchrun.

        Returns the ranks' saved records, in rank order."""
        deadline = time.time() + grace_s
        tmp = self.notice_file.with_name(self.notice_file.name + ".tmp")
        tmp.write_text(json.dumps({"reason": "notice", "deadline": deadline,
                                   "id": f"test-{self.name}"}))
        os.replace(tmp, self.notice_file)
        saved = [Path(f"{self.notice_file}.saved.{r}") for r in range(self.nproc)]
        while time.time() < deadline and not all(p.exists() for p in saved):
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode} before "
                                     f"saving:\n{self.output()[-4000:]}")
            time.sleep(0.05)
        # a worker that said it saved stays alive (never exits 0 mid-job) until SIGTERM
        assert self.proc.poll() is None, self.output()[-4000:]
        os.kill(self.proc.pid, signal.SIGTERM)
        rc = self.finish(60)
        assert rc != 0, f"{self.name} exited 0 after a notice:\n{self.output()[-4000:]}"
        return [json.loads(p.read_text()) for p in saved if p.exists()]

    def finish(self, timeout: float = 240.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"{self.name} still running after {timeout:.0f} s:\n"
                                 + self.output()[-4000:]) from None

    def kill(self) -> None:
        """SIGKILL torchrun and its workers at once, as a lost machine ends them (torchrun
        starts each worker in a session of its own, out of torchrun's process group)."""
        if self.proc.poll() is None:
            workers = _descendants(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()


def _descendants(pid: int) -> list[int]:
    """The processes under `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
