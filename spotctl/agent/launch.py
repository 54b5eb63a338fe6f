"""The worker process torchrun supervises: runs the training script in a child forked by
the node's warm zygote (see spotctl.agent.zygote), or execs it cold when there is none.
`-m MODULE` runs a module the same way (the torchft engine's torchrun)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def _cold(argv: list[str]) -> None:
    if argv[0] != "-m" and os.environ.get("SPOTCTL_STATUS_DIR") and "LOCAL_RANK" in os.environ:
        # a worker: run the script through the hook that recognises a plain torchrun
        # script at its init_process_group (spotctl.elastic.plain), as the zygote does
        argv = ["-m", "spotctl.agent.launch", "--worker", *argv]
    os.execv(sys.executable, [sys.executable, *argv])


def _worker(argv: list[str]) -> int:
    """`--worker SCRIPT ARGS`: the script as `python SCRIPT ARGS` runs it, hook installed."""
    import runpy

    from spotctl.elastic.plain import install

    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    install()
    runpy.run_path(argv[0], run_name="__main__")
    return 0


def _reraise(signals: list[int]) -> None:
    """Die of the first signal that came before there was a child to forward it to."""
    for sig in signals:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)


def main(argv: list[str]) -> int:
    if not argv or argv == ["-m"]:
        print("usage: python -m spotctl.agent.launch SCRIPT [ARGS] | -m MODULE [ARGS]",
              file=sys.stderr)
        return 2
    if argv[0] == "--worker":
        return _worker(argv[1:])
    path = os.environ.get("SPOTCTL_ZYGOTE", "")
    if not path:
        _cold(argv)
    # the handlers go in before the zygote is asked: torchrun's SIGTERM may come while the
    # child starts, and it must reach the child (not kill this process and leave the child
    # to notice the closed socket later); it is forwarded once the child's pid is known
    pid = 0
    early: list[int] = []

    def forward(sig: int, frame: object) -> None:
        if not pid:
            early.append(sig)
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
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
        _reraise(early)
        _cold(argv)  # exec sets the handlers back to the defaults
        return 1  # not reached
    for held in early:
        forward(held, None)
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
