"""Host keys learned out of band (EC2 console output, GCP guest attributes), pinned in
the cluster's known_hosts before the first SSH connection.

This module owns turning a cloud's report of a VM's SSH host keys into known_hosts
entries: parsing cloud-init's "BEGIN SSH HOST KEY KEYS" block, and `pin_host_keys`, which
writes the keys for a host name and drops any older pin of that name (cloud addresses are
reused by other VMs). A VM publishes its keys late in its boot (cloud-init's last stage
on EC2, the guest agent on GCP): `pin_published` waits for them (HOST_KEY_WAIT_S) before
the first connection. Without a report even then, the first connection pins on first use
(spotctl/remote/ssh.py), and an older pin of that address (another VM's) is dropped
rather than refuse the new VM for good; with one, even the first connection is verified.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

BEGIN = "-----BEGIN SSH HOST KEY KEYS-----"
END = "-----END SSH HOST KEY KEYS-----"
# how long a VM just launched is given to publish its host keys, and how often they are read
HOST_KEY_WAIT_S = 150.0
HOST_KEY_POLL_S = 5.0
KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
             "ecdsa-sha2-nistp521", "ssh-rsa")  # fmt: skip


def parse_console_keys(text: str) -> list[tuple[str, str]]:
    """(type, base64) pairs from the last host-key block of a console log."""
    start = text.rfind(BEGIN)
    end = text.find(END, start)
    if start < 0 or end < 0:
        return []
    out = []
    for line in text[start + len(BEGIN) : end].splitlines():
        parts = line.strip().split()
        if len(parts) >= 2 and valid_key(parts[0], parts[1]):
            out.append((parts[0], parts[1]))
    return out


def valid_key(kind: str, b64: str) -> bool:
    """A known key type whose blob decodes and names that same type."""
    if kind not in KEY_TYPES:
        return False
    try:
        blob = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        return False
    n = int.from_bytes(blob[:4], "big") if len(blob) >= 4 else -1
    return blob[4 : 4 + n] == kind.encode()


def _replace_pins(known_hosts: Path, host: str, new: list[str]) -> bool:
    """Under the file's lock: drop every pin of `host`, append `new` lines, write the file
    0600 atomically. Whether anything changed."""
    path = Path(known_hosts)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path.with_name(path.name + ".lock"), "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        lines = path.read_text().splitlines() if path.exists() else []
        kept = [ln for ln in lines if ln.split(" ", 1)[0] != host]
        if not new and len(kept) == len(lines):
            return False
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(ln + "\n" for ln in kept + new))
        os.replace(tmp, path)
    return True


def pin_host_keys(known_hosts: Path, host: str, keys: list[tuple[str, str]]) -> bool:
    """Make `keys` the pins of `host` (replacing older ones); False when there are none."""
    keys = [(k, b) for k, b in keys if valid_key(k, b)]
    if not keys or not host:
        return False
    return _replace_pins(known_hosts, host, [f"{host} {k} {b}" for k, b in keys])


def wait_settings(options: dict[str, object]) -> tuple[float, float]:
    """(wait, poll) seconds for a fresh VM's keys: the provider options `host_key_wait_s`
    / `host_key_poll_s`, else SPOTCTL_HOST_KEY_WAIT_S (the test suite's stand-ins publish
    no keys), else HOST_KEY_WAIT_S / HOST_KEY_POLL_S."""
    wait = options.get("host_key_wait_s", os.environ.get("SPOTCTL_HOST_KEY_WAIT_S",
                                                         HOST_KEY_WAIT_S))
    poll = options.get("host_key_poll_s", HOST_KEY_POLL_S)
    w, p = float(wait), float(poll)  # type: ignore[arg-type]
    return w, min(p, max(w, 0.01))


def unpin(known_hosts: Path, host: str) -> bool:
    """Drop every pin of `host`; whether there was one."""
    if not host or not Path(known_hosts).exists():
        return False
    return _replace_pins(known_hosts, host, [])


def pin_published(known_hosts: Path, host: str, read: Callable[[], list[tuple[str, str]]],
                  *, fresh: bool, wait_s: float = HOST_KEY_WAIT_S,
                  poll_s: float = HOST_KEY_POLL_S, sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic) -> bool:
    """Pin the keys the cloud publishes for the VM at `host` (`read()`: [] until it has).
    A VM just launched (`fresh`) is given up to `wait_s` to publish them; if it has not,
    any older pin of `host` (another VM's: addresses are reused) is dropped, so that the
    first connection pins on first use instead of failing on a changed key for good.
    Whether keys were pinned."""
    deadline = clock() + (wait_s if fresh else 0.0)
    while True:
        if pin_host_keys(known_hosts, host, read()):
            return True
        if clock() >= deadline:
            break
        sleep(poll_s)
    if fresh:
        unpin(known_hosts, host)
    return False
