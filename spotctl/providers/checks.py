"""Pre-flight checks of a cloud account (`spotctl check`): the result type and the runner.

This module owns what one check line is (name, ok, detail, whether a failure blocks `up`)
and `run_check`, which turns a typed spotctl error raised by a check into a failed line
(one line, never a traceback). Each cloud provider's `checks()` (spotctl/providers/aws/
check.py, spotctl/providers/gcp/check.py) returns a list of these, in a fixed order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from spotctl.errors import SpotctlError


@dataclass
class Check:
    name: str  # "credentials", "region", "spot GPU quota", "network", "image", ...
    ok: bool
    detail: str  # one line: what was found, or what is wrong and what to do
    blocking: bool = True  # a failure here stops `up`; False: a warning
    # what the check looked at, for --json (the launch check: the request it DryRan)
    data: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["data"] is None:
            del d["data"]
        return d


def jsonable(value: Any) -> Any:
    """A request as JSON would carry it (tuples as lists, everything else as str)."""
    import json

    return json.loads(json.dumps(value, default=str))


def run_check(name: str, fn: Callable[[], str], blocking: bool = True) -> Check:
    """`fn` returns the detail of a passing check, or raises to fail it."""
    try:
        return Check(name, True, fn(), blocking)
    except SpotctlError as e:
        return Check(name, False, " ".join(str(e).split()), blocking)
