"""Which interpreter a node's venv is made from, decided by asking the node first.

Before anything is installed, one SSH command asks each candidate interpreter on the node
(first the image's torch environments, `[train] torch_envs`: the Deep Learning AMI's
/opt/pytorch, the Deep Learning VM's /opt/conda; then the base python; then, unless
`[train] python` names the one to use, the python3 a login shell finds) for its version,
whether it has `ensurepip` (Debian and Ubuntu ship python3 without it unless python3-venv
is installed), its torch version (read from the installed metadata, never imported) and
the machine. The pick:

- the login shell's python3 is used only for its torch (2.9 or newer); a candidate whose
  Python spotctl's own wheel excludes (Requires-Python), or that has no venv module, is
  never used;
- among the rest, one with a torch of at least MIN_TORCH first (its venv sees that torch
  through the system site-packages: no multi-GB download), one with an older torch last
  (the bootstrap hides that torch from the venv and installs TORCH_SPEC, as it does where
  there is none: spotctl.remote.package); then one whose Python every pin allows (a Python
  older than some pins allow installs older releases of those from the node's package
  index: `NodePython.older`, spotctl.remote.package); then one whose Python takes every
  shipped wheel as it is (no package index needed); then the candidates' order;
- none usable: the bootstrap stops with one line naming each interpreter's Python and
  why, before anything is installed on the node.

A missing `ensurepip` is no reason to skip an interpreter: the bootstrap then makes the
venv `--without-pip` and installs pip from the uploaded pip wheel (no index needed).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spotctl.errors import BootstrapError
from spotctl.remote.package import MIN_TORCH, NodePackage
from spotctl.remote.ssh import HostTarget, run

if TYPE_CHECKING:
    from fabric import Connection

_PROBE = r"""
import sys, json, platform, importlib.util as u
try:
    from importlib import metadata as md
    tv = md.version("torch") if u.find_spec("torch") else ""
except Exception:
    tv = ""
print("spotctl-python " + json.dumps({"path": sys.argv[1], "executable": sys.executable,
    "version": list(sys.version_info[:3]), "ensurepip": bool(u.find_spec("ensurepip")),
    "venv": bool(u.find_spec("venv")), "torch": tv, "machine": platform.machine()}))
"""


@dataclass(frozen=True)
class NodePython:
    """One interpreter found on a node."""

    path: str  # as the candidate list names it (what the bootstrap runs)
    version: tuple[int, int, int]
    ensurepip: bool  # False: the venv is made --without-pip, pip comes from its wheel
    venv: bool  # the venv module itself
    torch: str  # installed torch version, "" = none
    machine: str  # platform.machine(), e.g. x86_64
    # some shipped pins exclude this Python: the node takes the newest releases up to the
    # controller's that it allows, from its package index (set by `choose`)
    older: bool = False

    @property
    def py(self) -> str:
        return f"Python {self.version[0]}.{self.version[1]}"

    def torch_ok(self) -> bool:
        m = re.match(r"(\d+)\.(\d+)", self.torch)
        return m is not None and (int(m.group(1)), int(m.group(2))) >= MIN_TORCH


def probe_command(candidates: Sequence[str], login: bool = False) -> str:
    """One shell command: each candidate that exists prints one `spotctl-python` line.
    With `login`, also the python3 a login shell finds (by its absolute path): where an
    image's profile puts its torch environment on PATH (as the one a user gets on SSH),
    wherever the image keeps it. A profile that waits is cut off after 20 s."""
    code = shlex.quote(_PROBE)
    parts = []
    for c in candidates:
        q = shlex.quote(c)
        parts.append(f'if command -v {q} >/dev/null 2>&1; then {q} -c {code} {q} '
                     '2>/dev/null || true; fi')
    if login:
        find = shlex.quote("command -v python3")
        parts.append(f"p=$( (timeout 20 bash -lc {find} || timeout 20 sh -lc {find}) "
                     "</dev/null 2>/dev/null | tail -n 1); "
                     f'case "$p" in /*) "$p" -c {code} "$p" 2>/dev/null || true;; esac')
    return "; ".join(parts) or "true"


def parse_probe(stdout: str) -> list[NodePython]:
    out = []
    for line in stdout.splitlines():
        if not line.startswith("spotctl-python "):
            continue
        try:
            d = json.loads(line.split(" ", 1)[1])
            v = [int(x) for x in d["version"]][:3]
            out.append(NodePython(str(d["path"]), (v[0], v[1], v[2]), bool(d["ensurepip"]),
                                  bool(d["venv"]), str(d.get("torch") or ""),
                                  str(d.get("machine") or "")))
        except (ValueError, KeyError, TypeError, IndexError):
            continue
    return out


def choose(found: Sequence[NodePython], candidates: Sequence[str], package: NodePackage,
           label: str) -> NodePython:
    """The interpreter to build the node's venv from (see the module docstring), or a
    BootstrapError that names every interpreter's Python and what the wheels need."""
    order = {c: i for i, c in enumerate(candidates)}
    # the login shell's python3 (no candidate names it) is wanted only for a torch to reuse
    found = [p for p in found if p.path in order or p.torch_ok()]
    if not found:
        raise BootstrapError(
            f"{label}: no Python interpreter on the node ({', '.join(candidates)} not found); "
            "the image needs python3")
    usable: list[tuple[tuple[bool, bool, bool, bool, int], NodePython]] = []
    refused: list[str] = []
    for p in found:
        if not p.venv:
            refused.append(f"{p.path} ({p.py}) has no venv module")
            continue
        own = package.own_fit(p.version[:2])
        if own:
            refused.append(f"{p.path} is {p.py}; {own}")
            continue
        hard, soft = package.fit(p.version[:2], p.machine)
        if hard:
            p = dataclasses.replace(p, older=True)
        # an older torch would be seen by the venv (and then used): such an
        # environment comes after any without torch
        old_torch = bool(p.torch) and not p.torch_ok()
        usable.append(((not p.torch_ok(), old_torch, bool(hard), bool(soft),
                        order.get(p.path, len(order))), p))
    if not usable:
        raise BootstrapError(
            f"{label}: no interpreter on the node can run spotctl: "
            + "; ".join(refused)
            + ". Install a newer python3 on the image, or name one in "
              "train.torch_envs (or ssh.base_python)")
    return min(usable, key=lambda x: x[0])[1]


def python_chooser(package: NodePackage, candidates: Sequence[str], login: bool = False
                   ) -> Callable[[Connection, HostTarget], NodePython]:
    """The bootstrap's probe step: ask the node (with `login`, also its login shell's
    python3), pick (or raise)."""

    def pick(conn: Connection, target: HostTarget) -> NodePython:
        r = run(conn, probe_command(candidates, login), 120)
        return choose(parse_probe(r.stdout), candidates, package, target.label)

    return pick


def candidates_for(torch_envs: Sequence[str], base: str) -> list[str]:
    """The image's torch environments first, then the base interpreter (deduplicated)."""
    return list(dict.fromkeys([*torch_envs, base]))
