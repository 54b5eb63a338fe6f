"""Warm worker starts: a per-node process that has already imported torch forks each new
worker, so a restart after a rescale does not pay for the interpreter and torch imports
(seconds) on the critical path.

    zygote:   python -m spotctl.agent.zygote SOCKET     (started by the node agent)
    worker:   torchrun ... -m spotctl.agent.launch train.py ARGS
    torchrun: python -m spotctl.agent.launch -m torch.distributed.run ...   (torchft engine)

`spotctl.agent.launch` (the process torchrun supervises) hands its argv, environment,
working directory and stdio to the zygote over a unix socket; the zygote forks a child
that becomes the worker (runpy of the script as __main__). The launcher forwards signals
to the child and exits with its status; if the launcher dies, the child kills itself.
Without a zygote the launcher simply execs the script the usual way.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import select
import signal
import socket
import sys

MAX_MSG = 1 << 20


def _child(conn: socket.socket, req: dict, fds: list[int]) -> None:
    import runpy
    import threading

    for i, fd in enumerate(fds[:3]):
        os.dup2(fd, i)
    for fd in fds:
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    argv = list(req["argv"])
    # `-m MODULE ARGS` (the torchft engine's torchrun) or `SCRIPT ARGS`, as python takes them
    module = argv[1] if argv[0] == "-m" else None
    if module is not None:
        sys.argv = [module, *argv[2:]]  # runpy puts the module's file first
        sys.path.insert(0, req["cwd"])
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)

    def watch_launcher() -> None:
        # the launcher closed its end (it died): a worker must not outlive it
        try:
            conn.recv(1)
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch_launcher, daemon=True).start()
    if module is None:
        # a worker: recognise a plain torchrun script at its init_process_group
        from spotctl.elastic.plain import install

        install()
    code = 0
    try:
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _cuda_initialized() -> bool:
    """True once this process holds a CUDA context (fork would hand children a broken one)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA support: nothing initialised
        return False


ACCEPT_WAIT_S = 5.0  # for a connected client's request


def serve(path: str) -> None:
    # the agent that starts the zygote is the only one that asks it for workers: once the
    # zygote is handed to another parent (the agent died), it ends instead of lingering,
    # as soon as no worker it forked still runs (their launchers wait on it for status)
    parent = os.getppid()
    # Listen first, then import: the agent starts the zygote and torchrun together, and a
    # launcher that found no socket yet would start its worker cold (paying the imports
    # again, on the start-up or join path). Its request waits in the backlog instead.
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(64)
    # warm everything a worker imports; nothing here may start threads before fork
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    # a worker's first optimizer imports torch._dynamo (about 200 modules, half a second
    # of CPU) on its start-up path; imported here once, it starts no thread. Not where
    # Triton is installed (CUDA builds): torch._dynamo imports it, and no version of it
    # is known here never to touch the CUDA driver on import (which would break CUDA in
    # every forked worker); those workers import it after the fork, as before.
    if importlib.util.find_spec("triton") is None:
        try:
            import torch._dynamo  # noqa: F401
        except Exception:  # noqa: BLE001 - a torch without it: the worker imports it
            pass

    import spotctl.elastic  # noqa: F401
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent or children:
        r, _, _ = select.select([srv], [], [], 0.05)
        if r:
            conn, _ = srv.accept()
            # a launcher sends its request as soon as it connects; a client that sends
            # nothing must not hold every later launcher behind it
            conn.settimeout(ACCEPT_WAIT_S)
            try:
                msg, fds, _, _ = socket.recv_fds(conn, MAX_MSG, 8)
                req = json.loads(msg)
            except (OSError, ValueError):
                conn.close()
                continue
            conn.settimeout(None)
            if _cuda_initialized():
                # a forked child cannot use CUDA its parent initialised: the launcher
                # reads this refusal and starts the worker cold instead
                try:
                    conn.sendall(json.dumps({"error": "CUDA is initialised in the zygote; "
                                             "refusing to fork"}).encode() + b"\n")
                except OSError:
                    pass
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            # Objects that exist now are never collected in the child: a collection there
            # would touch every one of them and copy the whole warm heap page by page.
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                srv.close()
                for c in children.values():
                    c.close()
                _child(conn, req, fds)
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            except OSError:
                pass
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            done = children.pop(pid, None)
            if done is not None:
                conn = done
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
