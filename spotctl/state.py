"""Local state: a SQLite journal (WAL) of clusters, nodes and events, plus one directory
per cluster for its token, head, local nodes, known_hosts and lock.

The cloud's tags/labels are the source of truth for which instances exist; this database
is the journal and the cache. `SPOTCTL_HOME` overrides the platform state dir (tests).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotctl.errors import LockHeld, NotFoundError, StateError

SCHEMA = """
CREATE TABLE IF NOT EXISTS clusters (
  name TEXT PRIMARY KEY,
  provider TEXT NOT NULL,
  spec_json TEXT NOT NULL,
  state TEXT NOT NULL,
  created_at REAL NOT NULL,
  updated_at REAL NOT NULL,
  head_json TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS nodes (
  id TEXT NOT NULL,
  cluster TEXT NOT NULL,
  provider TEXT NOT NULL,
  zone TEXT NOT NULL DEFAULT '',
  instance_type TEXT NOT NULL DEFAULT '',
  gpus INTEGER NOT NULL DEFAULT 0,
  state TEXT NOT NULL,
  price REAL NOT NULL DEFAULT 0,
  on_demand_price REAL NOT NULL DEFAULT 0,
  launched_at REAL NOT NULL,
  ended_at REAL,
  request_id TEXT NOT NULL DEFAULT '',
  address TEXT NOT NULL DEFAULT '',
  meta_json TEXT NOT NULL DEFAULT '{}',
  PRIMARY KEY (cluster, id)
);
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  cluster TEXT NOT NULL,
  ts REAL NOT NULL,
  type TEXT NOT NULL,
  data_json TEXT NOT NULL DEFAULT '{}',
  source_key TEXT UNIQUE
);
CREATE INDEX IF NOT EXISTS events_cluster ON events (cluster, ts);
"""


def home() -> Path:
    env = os.environ.get("SPOTCTL_HOME")
    if env:
        p = Path(env)
    else:
        from platformdirs import user_state_dir

        p = Path(user_state_dir("spotctl"))
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    return p


def write_private(path: Path, text: str) -> None:
    """Write a secret-bearing file atomically with mode 0600 from the first byte."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (the directory entry, not only the data)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any, mode: int = 0o644) -> None:
    """Replace `path` with `obj` as JSON: after a crash it is either old or new, whole
    (data fsynced before the rename, the directory after)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@dataclass
class NodeRow:
    id: str
    cluster: str
    provider: str
    zone: str
    instance_type: str
    gpus: int
    state: str
    price: float
    on_demand_price: float
    launched_at: float
    ended_at: float | None
    request_id: str
    address: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterRow:
    name: str
    provider: str
    spec: dict[str, Any]
    state: str
    created_at: float
    updated_at: float
    head: dict[str, Any]


def lock_holder(path: Path) -> str:
    """Who holds the lock at `path`, in words (from what the holder wrote into it)."""
    try:
        h = json.loads(path.read_text() or "{}")
        since = time.strftime("%H:%M:%S", time.localtime(float(h["since"])))
        return f"held by pid {int(h['pid'])} since {since}: {str(h.get('command', ''))[:120]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "lock held"


class ClusterDir:
    """The per-cluster directory (0700): token, head files, local nodes, known_hosts."""

    def __init__(self, root: Path, name: str):
        self.home = root  # the state directory (SPOTCTL_HOME) it lies in
        self.path = root / "clusters" / name
        self.name = name

    def ensure(self) -> ClusterDir:
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path, 0o700)
        return self

    @property
    def token_file(self) -> Path:
        return self.path / "token"

    def token(self, create: bool = False) -> str:
        if not self.token_file.exists():
            if not create:
                raise StateError(f"cluster {self.name}: token file missing")
            write_private(self.token_file, secrets.token_urlsafe(32))
        return self.token_file.read_text().strip()

    @property
    def head_dir(self) -> Path:
        return self.path / "head"

    @property
    def nodes_dir(self) -> Path:
        return self.path / "nodes"

    @property
    def known_hosts(self) -> Path:
        return self.path / "known_hosts"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @contextmanager
    def lock(
        self, what: str = "reconcile", wait: bool = True,
        on_wait: Callable[[str, float | None], None] | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[None]:
        """One reconcile (up/rebalance/down) at a time per cluster, across processes.

        The holder writes who it is (pid, command, since) into the lock file; a caller
        that has to wait is told that (`on_wait`) and errors name it."""
        self.ensure()
        path = self.path / f"{what}.lock"
        # never truncate on open: the file names the current holder
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "r+")
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = lock_holder(path)
                if not wait:
                    raise LockHeld(
                        f"cluster {self.name}: another {what} is running ({holder})"
                    ) from None
                if on_wait is not None:
                    on_wait(f"waiting for the {what} lock of {self.name}: {holder}", None)
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                while True:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if deadline is not None and time.monotonic() >= deadline:
                            raise StateError(
                                f"cluster {self.name}: the {what} lock is still held after "
                                f"{timeout_s:.0f}s ({lock_holder(path)})"
                            ) from None
                        time.sleep(0.2)
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"pid": os.getpid(), "since": time.time(),
                                "command": " ".join(sys.argv)[:300]}))
            f.flush()
            yield
        finally:
            f.close()


class Store:
    """The SQLite journal. Short transactions; safe across processes (WAL, busy timeout)."""

    def __init__(self, root: Path | None = None):
        self.root = root or home()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.root / "state.db"
        try:
            self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA busy_timeout=30000")
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            raise StateError(f"state database {self.path} is unusable: {e}") from None
        self.db.row_factory = sqlite3.Row
        os.chmod(self.path, 0o600)

    def close(self) -> None:
        self.db.close()

    def cluster_dir(self, name: str) -> ClusterDir:
        return ClusterDir(self.root, name)

    # clusters
    def upsert_cluster(self, name: str, provider: str, spec: dict[str, Any], state: str) -> None:
        now = time.time()
        self.db.execute(
            "INSERT INTO clusters (name, provider, spec_json, state, created_at, updated_at)"
            " VALUES (?,?,?,?,?,?) ON CONFLICT(name) DO UPDATE SET provider=excluded.provider,"
            " spec_json=excluded.spec_json, state=excluded.state, updated_at=excluded.updated_at",
            (name, provider, json.dumps(spec), state, now, now),
        )

    def set_cluster_state(self, name: str, state: str) -> None:
        self.db.execute(
            "UPDATE clusters SET state=?, updated_at=? WHERE name=?", (state, time.time(), name)
        )

    def set_head(self, name: str, head: dict[str, Any]) -> None:
        self.db.execute("UPDATE clusters SET head_json=? WHERE name=?", (json.dumps(head), name))

    def get_cluster(self, name: str) -> ClusterRow:
        row = self.db.execute("SELECT * FROM clusters WHERE name=?", (name,)).fetchone()
        if row is None:
            raise NotFoundError(f"no cluster named {name!r} (see `spotctl list`)")
        return ClusterRow(
            name=row["name"],
            provider=row["provider"],
            spec=json.loads(row["spec_json"]),
            state=row["state"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            head=json.loads(row["head_json"]),
        )

    def clusters(self) -> list[ClusterRow]:
        names = [r["name"] for r in self.db.execute("SELECT name FROM clusters ORDER BY name")]
        return [self.get_cluster(n) for n in names]

    def delete_cluster(self, name: str) -> None:
        self.db.execute("DELETE FROM clusters WHERE name=?", (name,))

    # nodes
    def upsert_node(self, n: NodeRow) -> None:
        self.db.execute(
            "INSERT INTO nodes (id, cluster, provider, zone, instance_type, gpus, state, price,"
            " on_demand_price, launched_at, ended_at, request_id, address, meta_json)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(cluster, id) DO UPDATE SET"
            " zone=excluded.zone, instance_type=excluded.instance_type, gpus=excluded.gpus,"
            " state=excluded.state, ended_at=excluded.ended_at, address=excluded.address,"
            " meta_json=excluded.meta_json",
            (
                n.id, n.cluster, n.provider, n.zone, n.instance_type, n.gpus, n.state, n.price,
                n.on_demand_price, n.launched_at, n.ended_at, n.request_id, n.address,
                json.dumps(n.meta),
            ),
        )

    def set_node_state(self, cluster: str, node_id: str, state: str, ended: bool = False) -> None:
        if ended:
            self.db.execute(
                "UPDATE nodes SET state=?, ended_at=COALESCE(ended_at, ?) WHERE cluster=? AND id=?",
                (state, time.time(), cluster, node_id),
            )
        else:
            self.db.execute(
                "UPDATE nodes SET state=? WHERE cluster=? AND id=?", (state, cluster, node_id)
            )

    def nodes(self, cluster: str, include_ended: bool = True) -> list[NodeRow]:
        q = "SELECT * FROM nodes WHERE cluster=?"
        if not include_ended:
            q += " AND ended_at IS NULL"
        rows = self.db.execute(q + " ORDER BY launched_at, id", (cluster,)).fetchall()
        return [
            NodeRow(
                id=r["id"], cluster=r["cluster"], provider=r["provider"], zone=r["zone"],
                instance_type=r["instance_type"], gpus=r["gpus"], state=r["state"],
                price=r["price"], on_demand_price=r["on_demand_price"],
                launched_at=r["launched_at"], ended_at=r["ended_at"],
                request_id=r["request_id"], address=r["address"],
                meta=json.loads(r["meta_json"]),
            )
            for r in rows
        ]

    # events
    def add_event(
        self,
        cluster: str,
        type_: str,
        data: dict[str, Any] | None = None,
        ts: float | None = None,
        source_key: str | None = None,
    ) -> None:
        """Journal one event. `source_key` dedupes events imported from the head."""
        self.db.execute(
            "INSERT OR IGNORE INTO events (cluster, ts, type, data_json, source_key)"
            " VALUES (?,?,?,?,?)",
            (cluster, ts if ts is not None else time.time(), type_, json.dumps(data or {}),
             source_key),
        )

    def events(self, cluster: str, type_: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM events WHERE cluster=?"
        args: list[Any] = [cluster]
        if type_:
            q += " AND type=?"
            args.append(type_)
        rows = self.db.execute(q + " ORDER BY ts, seq", args).fetchall()
        out = []
        for r in rows:
            # a row written before import was validated may hold anything: skip it rather
            # than crash status, events, cost or rebalance
            try:
                ts = float(r["ts"])
                data = json.loads(r["data_json"])
            except (TypeError, ValueError):
                continue
            if ts != ts or not isinstance(data, dict):
                continue
            ev = {"ts": ts, "type": str(r["type"])}
            ev.update((k, v) for k, v in data.items() if k not in ev)
            out.append(ev)
        return out
