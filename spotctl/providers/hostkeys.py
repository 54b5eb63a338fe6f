"""Host keys learned out of band (EC2 console output, GCP guest attributes), pinned in
the cluster's known_hosts before the first SSH connection.

This module owns turning a cloud's report of a VM's SSH host keys into known_hosts
entries: parsing cloud-init's "BEGIN SSH HOST KEY KEYS" block, and `pin_host_keys`, which
writes the keys for a host name and drops any older pin of that name (cloud addresses are
reused by other VMs). Without a report, the first connection still pins on first use
(spotctl/remote/ssh.py); with one, even the first connection is verified.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import os
from pathlib import Path

BEGIN = "-----BEGIN SSH HOST KEY KEYS-----"
END = "-----END SSH HOST KEY KEYS-----"
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


def pin_host_keys(known_hosts: Path, host: str, keys: list[tuple[str, str]]) -> bool:
    """Make `keys` the pins of `host` (replacing older ones); False when there are none."""
    keys = [(k, b) for k, b in keys if valid_key(k, b)]
    if not keys or not host:
        return False
    path = Path(known_hosts)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path.with_name(path.name + ".lock"), "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        lines = path.read_text().splitlines() if path.exists() else []
        kept = [ln for ln in lines if ln.split(" ", 1)[0] != host]
        kept += [f"{host} {k} {b}" for k, b in keys]
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(kept) + "\n")
        os.replace(tmp, path)
    return True
