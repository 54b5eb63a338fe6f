"""The worker process torchrun supervises: runs the training script in a child forked by
the node's warm zygote (see spotctl.agent.zygote), or execs it cold when there is none."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def _cold(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m spotctl.agent.launch SCRIPT [ARGS]", file=sys.stderr)
        return 2
    path = os.environ.get("SPOTCTL_ZYGOTE", "")
    if not path:
        _cold(argv)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        msg = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(s, [msg], [0, 1, 2])
        f = s.makefile("rb")
        hello = json.loads(f.readline())
        pid = int(hello["pid"])
    except (OSError, ValueError, KeyError):
        s.close()
        _cold(argv)
        return 1  # not reached

    def forward(sig: int, frame: object) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            line = f.readline()
            break
        except InterruptedError:
            continue
    if not line:
        return 1  # the zygote died: the child was killed with it
    status = int(json.loads(line)["status"])
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return 128 + signum
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
