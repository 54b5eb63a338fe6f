"""Shared CLI bits: the console, JSON output, opening state and a cluster's spec."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from spotctl.errors import NotFoundError
from spotctl.spec import ClusterSpec
from spotctl.state import Store

NAME_HELP = "Cluster name (default: ./spotctl.toml's, else the only cluster)."


PIPE_WIDTH = 200  # a pipe has no terminal to fit: full rows, greppable


def console(stderr: bool = False) -> Console:
    """One console; plain text when not a terminal (tests, pipes). Tables fit its width:
    the terminal's, else $COLUMNS, else PIPE_WIDTH."""
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    no_color = bool(os.environ.get("NO_COLOR")) or not tty
    width = None if tty or os.environ.get("COLUMNS") else PIPE_WIDTH
    return Console(stderr=stderr, no_color=no_color, highlight=False, soft_wrap=False,
                   width=width)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def open_store() -> Store:
    return Store()


def cluster_spec(store: Store, name: str) -> ClusterSpec:
    row = store.get_cluster(name)
    return ClusterSpec.model_validate(row.spec)


def spec_file_name(path: Path | None = None) -> str | None:
    """The cluster name ./spotctl.toml gives (its default when the file names none)."""
    from spotctl.spec import tomllib  # tomli on Python 3.10

    path = path or Path.cwd() / "spotctl.toml"
    if not path.is_file():
        return None
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None  # `spotctl up` reports a broken spec; naming falls back to the store
    name = data.get("name", ClusterSpec.model_fields["name"].default)
    return name if isinstance(name, str) and name else None


def resolve_name(store: Store, name: str | None) -> str:
    """--name when given, else ./spotctl.toml's cluster, else the only cluster there is."""
    if name:
        return name
    from_file = spec_file_name()
    if from_file:
        return from_file
    names = [c.name for c in store.clusters()]
    if len(names) == 1:
        return names[0]
    if not names:
        raise NotFoundError("no clusters yet (`spotctl up` starts one)")
    raise NotFoundError(f"which cluster? pass --name, one of: {', '.join(sorted(names))}")
