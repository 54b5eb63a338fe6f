"""The local "cloud"'s capacity: a schedule from the spec, pinned at runtime by
capacity.set_capacity (what tests and demos use instead of racing a wall clock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotctl.providers.base import ProviderContext
from spotctl.providers.local import capacity
from spotctl.providers.local.provider import LocalProvider
from spotctl.spec import ClusterSpec
from spotctl.state import Store


def provider(tmp_path: Path) -> LocalProvider:
    spec = ClusterSpec.model_validate({
        "name": "cap", "provider": "local", "gpus": "1..3",
        "local": {"capacity": [{"at_s": 0, "nodes": 3}, {"at_s": 3600, "nodes": 1}]},
    })
    store = Store(tmp_path / "home")
    return LocalProvider(ProviderContext(cluster="cap", spec=spec,
                                         cluster_dir=store.cluster_dir("cap"), options={}))


def test_override_wins_over_the_schedule_and_survives_prepare(tmp_path: Path) -> None:
    p = provider(tmp_path)
    p.prepare()
    d = p.cdir.path
    assert p.capacity_now() == 3 and capacity.current(d) == 3
    capacity.set_capacity(d, 2)
    assert p.capacity_now() == 2 and capacity.current(d) == 2
    assert p.offers()[0].available == 2  # nothing runs yet
    before = (d / "capacity.json").stat().st_mtime_ns
    p.prepare()  # every reconcile prepares: it must not touch the file (no race)
    assert (d / "capacity.json").stat().st_mtime_ns == before
    assert capacity.current(d) == 2
    capacity.set_capacity(d, None)  # back to the schedule
    assert capacity.current(d) == 3
    cfg = json.loads((d / "capacity.json").read_text())
    assert "override" not in cfg and cfg["schedule"][1]["nodes"] == 1
    assert capacity.current(d, now=cfg["created_at"] + 3601) == 1


def test_bad_capacity_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        capacity.set_capacity(tmp_path, -1)
    assert capacity.current(tmp_path) is None  # no capacity.json: unlimited
