"""Benchmarks of `scripts/bench`: one module per benchmark, each with
`bench(ctx, ...) -> list[Row]` (spotctl figure next to its baseline, measured in the
same run). recovery, lost and join share one pair of cluster sessions (cluster.py)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

NAMES = ("recovery", "lost", "join", "checkpoint", "control", "quorum", "overhead", "network",
         "scale", "plain", "churn", "zones", "frameworks")
# run only when named: churn is three settings of --minutes (default 10) on spotctl and
# again on bare torchft, an hour and more; zones needs root (network namespaces);
# frameworks needs the hf and lightning extras
ONLY_BY_NAME = ("churn", "zones", "frameworks")


def get(name: str) -> Callable[..., Any]:
    if name not in NAMES:
        raise KeyError(name)
    return import_module(f"{__name__}.{name}").bench  # type: ignore[no-any-return]
