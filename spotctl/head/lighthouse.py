"""torchft's Lighthouse on the head: the quorum server of the torchft engine.

It runs in a child process of the head (LighthouseProcess: the filter's parsing does not
share the API's interpreter lock; the head starts it again should it die, and it dies
with the head). torchft's server itself binds loopback (an ephemeral port); the head's address (like the
rendezvous store: no authentication, reachable only from the cluster's nodes) is served by
spotctl.head.grpc_filter, which passes only the LighthouseService methods the Managers
call and the status page, never the dashboard's kill route. Started only for clusters
whose spec says `[train] engine = "torchft"` (the head is told with --lighthouse-port).

Timing (milliseconds; SPOTCTL_FT_* environment variables override). The quorum holds
still: it changes only when membership really changes.
- heartbeat_timeout: a replica whose heartbeats stop (its Manager's Rust side sends one
  every `heartbeat_interval`, 50 ms in spotctl.elastic.ft) counts as gone after this. A
  graceful leaver's Manager stops heartbeating as it exits and torchft 0.2.0 has no call
  to leave the Lighthouse, so this bounds the survivors' pause at a notice or a kill.
- join_timeout: how long a quorum whose previous members have not all asked yet waits for
  one that still heartbeats (a straggler: a slow step, a periodic save, a starved core).
  Long: a straggler is waited for, not left out and healed back at the next quorum. (A
  quorum whose previous members have all asked forms at once: torchft's fast quorum.)
- quorum_tick: how often the Lighthouse re-evaluates a pending quorum.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("spotctl.head.lighthouse")
WATCH_S = 2.0  # how often the inner listener is checked


@dataclass(frozen=True)
class LighthouseTiming:
    join_timeout_ms: int = 60_000
    heartbeat_timeout_ms: int = 250
    quorum_tick_ms: int = 20
    min_replicas: int = 1

    @classmethod
    def from_env(cls) -> LighthouseTiming:
        env = os.environ

        def num(key: str, default: int) -> int:
            v = env.get(key, "")
            if not v:
                return default
            if not v.isdigit() or int(v) < 1:
                raise ValueError(f"{key} must be a positive whole number of ms, not {v!r}")
            return int(v)

        d = cls()
        return cls(
            join_timeout_ms=num("SPOTCTL_FT_JOIN_TIMEOUT_MS", d.join_timeout_ms),
            heartbeat_timeout_ms=num("SPOTCTL_FT_HEARTBEAT_TIMEOUT_MS", d.heartbeat_timeout_ms),
            quorum_tick_ms=num("SPOTCTL_FT_QUORUM_TICK_MS", d.quorum_tick_ms),
            min_replicas=num("SPOTCTL_FT_MIN_REPLICAS", d.min_replicas),
        )


class _Addresses:
    """The addresses of a Lighthouse served on host:port, torchft's own on inner_port."""

    host: str
    port: int
    inner_port: int

    @property
    def address(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    @property
    def inner_address(self) -> str:
        """torchft's own server, unfiltered, on loopback (the filter's cost is measured
        against it)."""
        return f"http://127.0.0.1:{self.inner_port}"


class Lighthouse(_Addresses):
    """A running torchft LighthouseServer on loopback, served on host:port (port 0 = any
    free one) through the filter that passes only its gRPC methods and status page."""

    def __init__(self, host: str, port: int = 0, timing: LighthouseTiming | None = None):
        # torchft's Rust side logs every quorum request at info level otherwise
        os.environ.setdefault("RUST_LOG", "warn")
        import hpack  # noqa: F401 - the filter's decoder; missing, the head says so at start
        from torchft.coordination import LighthouseServer

        from spotctl.head.grpc_filter import GrpcFilter

        t = timing or LighthouseTiming.from_env()
        self.host = host
        self.timing = t
        self._make = LighthouseServer
        self._server: Any = self._start_inner(0)
        try:
            self._filter = GrpcFilter(host, port, ("127.0.0.1", self.inner_port))
        except BaseException:
            self._server.shutdown()
            raise
        self.port = self._filter.port
        self.restarts = 0
        self._stopping = threading.Event()
        self._watch = threading.Thread(target=self._watch_inner, name="lighthouse-watch",
                                       daemon=True)
        self._watch.start()

    def _start_inner(self, port: int) -> Any:
        t = self.timing
        server = self._make(
            bind=f"127.0.0.1:{port}", min_replicas=t.min_replicas,
            join_timeout_ms=t.join_timeout_ms, quorum_tick_ms=t.quorum_tick_ms,
            heartbeat_timeout_ms=t.heartbeat_timeout_ms,
        )
        # its own address() names the machine's hostname; the filter uses the bound address
        self.inner_port = int(str(server.address()).rsplit(":", 1)[1].strip("/"))
        return server

    def _watch_inner(self) -> None:
        """torchft's listener ends for good when an accept fails (it did at the open-file
        limit, issue 60): check that it still accepts every WATCH_S and start a new one in
        its place when it does not (on its port if free). The Managers' clients reconnect
        to the filter's address, which does not change; the new Lighthouse forms a new
        quorum from their next requests (spotctl.elastic.ft's quorum ids stay unique)."""
        while not self._stopping.wait(WATCH_S):
            try:
                socket.create_connection(("127.0.0.1", self.inner_port), timeout=5).close()
                continue
            except ConnectionRefusedError:
                pass
            except OSError:
                continue  # a timeout or this process's own limit: not the listener's end
            if self._stopping.is_set():
                return
            log.error("torchft's Lighthouse listener on 127.0.0.1:%d is gone; starting a "
                      "new one", self.inner_port)
            old = self._server
            try:
                old.shutdown()
            except Exception:  # noqa: BLE001 - it is being replaced either way
                pass
            for port in (self.inner_port, 0):
                try:
                    self._server = self._start_inner(port)
                    break
                except Exception as e:  # noqa: BLE001 - e.g. the port taken meanwhile
                    log.error("could not start torchft's Lighthouse on port %d: %s", port, e)
            else:
                continue
            self._filter.upstream = ("127.0.0.1", self.inner_port)
            self.restarts += 1

    @property
    def refused(self) -> int:
        """Connections the filter closed for what they sent."""
        return self._filter.refused

    def stop(self) -> None:
        self._stopping.set()
        self._watch.join(10)
        self._filter.stop()
        self._server.shutdown()


class LighthouseProcess(_Addresses):
    """The head's Lighthouse: the same server and filter as `Lighthouse`, in a process of
    their own. The filter parses every frame in Python; in the head's process it shared one
    interpreter lock with the API's thread per request, and at 64 nodes (256 heartbeats a
    second) a quorum took about twice what it took with the API idle (`scripts/bench
    scale`). Its own process also lets the head start it again should it die (`alive`,
    `restart`): on the same port, so the Managers reconnect to the address they have. It
    exits when the head does (its stdin closes; and the kernel's parent-death signal)."""

    def __init__(self, host: str, port: int = 0):
        import importlib.util

        for mod in ("torchft", "hpack"):
            if importlib.util.find_spec(mod) is None:
                raise ImportError(mod)
        self.host = host
        self.timing = LighthouseTiming.from_env()  # the child reads the same variables
        self.port = port
        self.inner_port = 0
        self.restarts = 0
        self._proc: Any = None
        self._start()

    def _start(self) -> None:
        import json
        import subprocess
        import sys

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "spotctl.head.lighthouse", self.host, str(self.port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True,
            env=dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn")))
        line = self._proc.stdout.readline()
        try:
            info = json.loads(line)
        except ValueError:
            self._proc.kill()
            self._proc.wait()
            raise OSError(
                f"the Lighthouse process did not start (exit {self._proc.returncode})") from None
        self.port, self.inner_port = int(info["port"]), int(info["inner_port"])

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def restart(self) -> None:
        """A new Lighthouse process on the same port (a quorum forms anew from the
        Managers' next requests, as after a head restart)."""
        self.stop()
        self.restarts += 1
        self._start()

    @property
    def refused(self) -> int:
        """Connections the filter closed for what they sent (asked of the process)."""
        if not self.alive():
            return 0
        self._proc.stdin.write("refused\n")
        self._proc.stdin.flush()
        return int(self._proc.stdout.readline() or 0)

    def stop(self) -> None:
        p = self._proc
        if p is None:
            return
        try:
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(5)
        except Exception:  # noqa: BLE001 - it is going either way
            p.kill()
            p.wait(5)


def _serve_child(host: str, port: int) -> int:
    """`python -m spotctl.head.lighthouse HOST PORT`: the Lighthouse and its filter; one JSON
    line with the ports on stdout, then a count of refusals per `refused` line on stdin;
    exits at stdin's end (the head closed it, or died)."""
    import ctypes
    import json
    import signal
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s lighthouse %(message)s")
    try:  # PR_SET_PDEATHSIG: a head killed outright takes this process with it
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    lh = Lighthouse(host, port)
    print(json.dumps({"port": lh.port, "inner_port": lh.inner_port}), flush=True)
    for line in sys.stdin:
        if line.strip() == "refused":
            print(lh.refused, flush=True)
    lh.stop()
    return 0


def start_lighthouse(host: str, port: int) -> LighthouseProcess | None:
    """The head's hook: a Lighthouse when asked for (port >= 0) and torchft is installed."""
    if port < 0:
        return None
    try:
        lh = LighthouseProcess(host, port)
    except ImportError:
        log.error("the spec asks for the torchft engine but torchft or hpack is not installed "
                  "on the head (pip install 'spotctl[train]')")
        return None
    log.info("torchft lighthouse on %s (%s), process %s", lh.address, lh.timing, lh._proc.pid)
    return lh


if __name__ == "__main__":
    import sys

    raise SystemExit(_serve_child(sys.argv[1], int(sys.argv[2])))
