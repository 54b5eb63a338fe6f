"""The controller's public address, for a cluster's SSH rule when `ssh_cidr` is not set.

This module owns one question and one decision: which address does this machine reach
the cloud from (SPOTCTL_CONTROLLER_ADDRESS when set, else AWS's checkip service, which
answers the caller's address in one line), and filling `[aws]`/`[gcp] ssh_cidr` from it
(one /32 or /128, never a range) with a line that says so. `up` fills it; `check` reports
what `up` would use.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from typing import Any

from spotctl.errors import SpecError
from spotctl.spec import ClusterSpec

ADDRESS_ENV = "SPOTCTL_CONTROLLER_ADDRESS"
CHECKIP_URL = "https://checkip.amazonaws.com"
CLOUDS = ("aws", "gcp")

Lookup = Callable[[], tuple[str, str]]


def public_address(timeout_s: float = 5.0) -> tuple[str, str]:
    """(this machine's public address, where it came from). Raises SpecError when it
    cannot be found or is not an address."""
    raw, source = os.environ.get(ADDRESS_ENV, "").strip(), f"${ADDRESS_ENV}"
    if not raw:
        import urllib.request

        source = CHECKIP_URL
        try:
            with urllib.request.urlopen(CHECKIP_URL, timeout=timeout_s) as resp:  # noqa: S310
                raw = resp.read(64).decode("ascii", "replace").strip()
        except OSError as e:
            raise SpecError(f"could not ask {CHECKIP_URL} for this machine's public "
                            f"address ({e})") from None  # fmt: skip
    try:
        return str(ipaddress.ip_address(raw)), source
    except ValueError:
        raise SpecError(f"{source} answered {raw[:40]!r}, not an IP address") from None


def _section(spec: ClusterSpec) -> Any:
    """The [aws] or [gcp] section of a cloud spec; None for other providers."""
    return getattr(spec, spec.provider) if spec.provider in CLOUDS else None


def ssh_cidr_line(spec: ClusterSpec, lookup: Lookup = public_address) -> tuple[str, str]:
    """(the CIDR SSH will be open to, a line saying where it comes from) for a cloud spec.
    Raises SpecError naming the field when it is unset and no address is found."""
    set_cidr = str(getattr(_section(spec), "ssh_cidr", "") or "")
    if set_cidr:
        return set_cidr, f"{spec.provider}.ssh_cidr = {set_cidr} (spotctl.toml)"
    try:
        addr, source = lookup()
    except SpecError as e:
        raise SpecError(f"{spec.provider}.ssh_cidr: not set and {e}; set it to the address "
                        'spotctl runs from, e.g. ssh_cidr = "203.0.113.7/32"') from None
    cidr = str(ipaddress.ip_network(addr))  # one address: /32 or /128
    return cidr, (f"{spec.provider}.ssh_cidr not set: SSH allowed from this machine's public "
                  f"address {cidr} (from {source}); set ssh_cidr in [{spec.provider}] to choose")


def fill_ssh_cidr(spec: ClusterSpec, lookup: Lookup = public_address) -> str | None:
    """Set an unset `[aws]`/`[gcp] ssh_cidr` to this machine's public address; the line to
    print when it did, None when nothing changed (set already, or not a cloud)."""
    section = _section(spec)
    if section is None or section.ssh_cidr:
        return None
    cidr, line = ssh_cidr_line(spec, lookup)
    section.ssh_cidr = cidr
    return line
