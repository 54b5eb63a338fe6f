"""What `spotctl report` draws between events: the job's world size, step and throughput,
sampled from the head's own status every few seconds into `samples.jsonl` in its folder.

Bounded on disk: at MAX_SAMPLES lines the file is thinned to every other sample and the
interval doubles, so a run of any length keeps an even picture in at most ~MAX_SAMPLES
short lines (about 100 bytes each).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from spotctl.head.client import HeadClient, HeadUnavailable

log = logging.getLogger("spotctl.head")
SAMPLES_FILE = "samples.jsonl"
MAX_SAMPLES = 4000
INTERVAL_S = 2.0


def sample_of(status: dict[str, Any], now: float) -> dict[str, Any]:
    nodes = status.get("nodes", {})
    tput = status.get("throughput")
    return {
        "ts": round(now, 3),
        "world_size": int(status.get("world_size") or 0),
        "step": int(status.get("step") or 0),
        "checkpoint_step": int(status.get("last_checkpoint_step") or 0),
        "throughput": None if tput is None else round(float(tput), 3),
        "nodes": sum(1 for n in nodes.values() if n.get("state") == "running"),
    }


def read_samples(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            s = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(s, dict) and isinstance(s.get("ts"), (int, float)):
            out.append(s)
    return out


class SampleLog:
    """Appends samples to `path`, thinning it (and slowing down) at `max_samples`."""

    def __init__(self, path: Path, interval_s: float = INTERVAL_S, max_samples: int = MAX_SAMPLES):
        self.path = path
        self.max_samples = max_samples
        self.interval_s = interval_s
        existing = read_samples(path)
        self.count = len(existing)
        self.last_ts: float | None = existing[-1]["ts"] if existing else None
        if len(existing) >= 2:  # a restarted head keeps the pace the file reached
            gap = existing[-1]["ts"] - existing[-2]["ts"]
            self.interval_s = max(interval_s, min(3600.0, gap * 0.9))

    def add(self, sample: dict[str, Any]) -> bool:
        """Append `sample` unless it comes sooner than the interval after the last one."""
        if self.last_ts is not None and sample["ts"] < self.last_ts + self.interval_s * 0.95:
            return False
        self.last_ts = sample["ts"]
        with open(self.path, "a") as f:
            f.write(json.dumps(sample, separators=(",", ":")) + "\n")
        self.count += 1
        if self.count >= self.max_samples:
            self._thin()
        return True

    def _thin(self) -> None:
        kept = read_samples(self.path)[::2]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(s, separators=(",", ":")) + "\n" for s in kept))
        os.replace(tmp, self.path)
        self.count = len(kept)
        self.interval_s *= 2


def start_sampler(dir: Path, token_file: Path) -> threading.Thread:
    """A daemon thread in the head's process that samples the head's status."""

    def run() -> None:
        slog = SampleLog(dir / SAMPLES_FILE)
        client: HeadClient | None = None
        while True:
            time.sleep(slog.interval_s)
            try:
                if client is None:
                    info = json.loads((dir / "head.json").read_text())
                    if info.get("pid") != os.getpid():
                        continue  # not written by this process yet
                    client = HeadClient(info["url"], token_file.read_text().strip(), timeout_s=2)
                slog.add(sample_of(client.status(), time.time()))
            except (OSError, ValueError, KeyError, HeadUnavailable) as e:
                log.debug("sample skipped: %s", e)

    t = threading.Thread(target=run, name="samples", daemon=True)
    t.start()
    return t
