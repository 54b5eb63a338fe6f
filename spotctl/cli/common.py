"""Shared CLI bits: the console, JSON output, opening state and a cluster's spec."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console

from spotctl.spec import ClusterSpec
from spotctl.state import Store


def console(stderr: bool = False) -> Console:
    """One console; plain text when not a terminal (tests, pipes)."""
    no_color = bool(os.environ.get("NO_COLOR")) or not sys.stdout.isatty()
    return Console(stderr=stderr, no_color=no_color, highlight=False, soft_wrap=False)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def open_store() -> Store:
    return Store()


def cluster_spec(store: Store, name: str) -> ClusterSpec:
    row = store.get_cluster(name)
    return ClusterSpec.model_validate(row.spec)
