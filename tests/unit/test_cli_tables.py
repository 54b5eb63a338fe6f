"""Every table spotctl prints fits 80 and 120 columns: no row wraps, no header is cut."""

from __future__ import annotations

import io
import time
from typing import Any

import pytest
from rich.console import Console

from spotctl.cli import cmd_cost, cmd_events, cmd_list, cmd_prices
from spotctl.control import status
from spotctl.control.cost import CostReport, NodeCost
from spotctl.control.tables import Col, fit_table
from spotctl.providers.aws import catalog as aws_catalog
from spotctl.providers.gcp import catalog as gcp_catalog

WIDTHS = (80, 120)


def render(obj: Any, width: int) -> list[str]:
    con = Console(width=width, file=io.StringIO(), color_system=None, soft_wrap=False)
    con.print(obj)
    return con.file.getvalue().splitlines()  # type: ignore[attr-defined]


def check_table(lines: list[str], width: int, headers: list[str], first_cells: list[str]) -> None:
    """No line is wider than the terminal; the header row holds every kept header whole;
    each data row is one line, starting with its first cell (a wrapped row would add lines
    that start with blanks)."""
    assert all(len(x.rstrip()) <= width for x in lines), "\n".join(lines)
    head = next(i for i, x in enumerate(lines) if x.split() and x.split()[0] == headers[0])
    kept = [h for h in headers if f" {h} " in f" {lines[head]} "]
    assert len(kept) >= 3 and "…" not in lines[head], lines[head]
    body = []
    for x in lines[head + 1:]:
        if not x.startswith(" ") and set(x.strip()) != {"─"}:  # the table ended (a footnote follows)
            break
        body.append(x)
    body = [x for x in body if x.strip() and set(x.strip()) != {"─"}]
    assert [x.split()[0] for x in body] == first_cells, "\n".join(lines)


def node(i: int, state: str, notice: bool = False, **kw: Any) -> dict[str, Any]:
    n = {"id": f"n{i}", "provider": "aws", "zone": "us-east-1a", "instance_type": "g5.12xlarge",
         "gpus": 4, "state": state, "uptime_s": 4000.0 + i, "heartbeat_age_s": 0.4,
         "step": 12345, "price": 1.62, "notice": notice, "incarnations": ["x"], "world_size": 8}
    n.update(kw)
    return n


@pytest.mark.parametrize("width", WIDTHS)
def test_status_table_fits(width: int) -> None:
    nodes = [node(1, "running"), node(2, "left", notice=True), node(3, "unresponsive"),
             node(14, "draining", notice=True, zone="europe-west4-a",
                  instance_type="a2-ultragpu-8g", heartbeat_age_s=None, step=None)]
    snap = {"cluster": "a-long-cluster-name", "provider": "aws",
            "gpus": {"now": 8, "min": 4, "max": 16}, "world_size": 8, "step": 123456,
            "last_checkpoint_step": 123400, "throughput": 1234.5, "cost_per_hour": 4.86,
            "cost": {"spent_usd": 12.3456, "on_demand_usd": 45.6789, "saved_usd": 33.3333},
            "drain": None, "head_error": None, "nodes": nodes}
    lines = render(status.render(snap, width=width), width)
    check_table(lines, width, ["node", "provider", "zone", "type", "GPUs", "state", "uptime",
                               "heartbeat", "hb", "step"], ["n1", "n2", "n3", "n14"])
    assert any("left*" in x for x in lines)
    assert "* got a preemption notice" in lines[-1]
    # the summary keeps each key with its value on one line
    assert any("GPUs 8 (min 4, max 16)" in x for x in lines)
    if width == 120:
        assert "heartbeat" in "\n".join(lines)  # the wide terminal keeps it, uncut


@pytest.mark.parametrize("width", WIDTHS)
def test_status_says_who_replaces_lost_nodes(width: int) -> None:
    """The head's reconcile loop as the head reports it: its last run, or that it is not
    running; a cluster whose head runs none shows no such line."""
    base = {"cluster": "c", "provider": "local", "gpus": {"now": 2, "min": 2, "max": 2},
            "world_size": 2, "step": 1, "last_checkpoint_step": 0, "throughput": None,
            "cost_per_hour": 0.0, "cost": None, "drain": None, "head_error": None,
            "nodes": [node(1, "running")]}
    now = time.time()
    head = {"running": True, "pid": 7, "restarts": 0, "ended": False, "last_exit": None,
            "interval_s": 60.0, "last_run": {"at": now - 12, "trigger": ["notice"],
            "skipped": False, "errors": [], "actions": ["replace: n1 got a notice " + "x" * 90]}}
    snap = dict(base, rebalancer=status._rebalancer(head, now))
    lines = render(status.render(snap, width=width), width)
    line = next(x for x in lines if x.startswith("replacements:"))
    assert line.startswith("replacements: by the head (last run 12.0s ago: replace: n1 got")
    assert len(line) <= width
    head["running"] = False
    lines = render(status.render(dict(base, rebalancer=status._rebalancer(head, now)), width), width)
    assert any("reconcile loop is not running (see head/rebalance.log)" in x for x in lines)
    lines = render(status.render(dict(base, rebalancer=status._rebalancer(None, now)), width), width)
    assert not any(x.startswith("replacements:") for x in lines)
    # a run that failed says so, and a head that reported garbage shows no run
    head.update(running=True, last_run={"at": now, "errors": ["aws: throttled"], "actions": []})
    assert "aws: throttled" in status.rebalancer_line(status._rebalancer(head, now))
    head["last_run"] = "x"
    assert status.rebalancer_line(status._rebalancer(head, now)).endswith("(no run yet)")


def all_event_types() -> list[dict[str, Any]]:
    t = time.time()
    return [
        {"ts": t, "type": "launch", "node": "n1", "zone": "us-east-1a",
         "instance_type": "g5.12xlarge", "gpus": 4, "price": 1.62, "request_id": "r",
         "reason": "below minimum: want 4 more GPUs"},
        {"ts": t, "type": "train-start", "world_size": 8, "resume_step": 0},
        {"ts": t, "type": "notice", "node": "n2", "source": "aws-imds", "kind": "spot",
         "action": "terminate", "deadline": t + 120, "received_at": t, "id": "x"},
        {"ts": t, "type": "drain-start", "gen": 3, "reason": "notice", "members": ["n1", "n2"],
         "leavers": ["n2"], "joiners": []},
        {"ts": t, "type": "drain-committed", "gen": 3, "step": 1200},
        {"ts": t, "type": "rescale", "from_world_size": 8, "to_world_size": 4,
         "reason": "notice", "checkpoint_step": 1200, "resume_step": 1200, "lost_steps": 0,
         "notice_to_resume_s": 4.6, "worker_start": {"a": 1}},
        {"ts": t, "type": "drain-requested", "nodes": ["n3", "n4"], "gen": 4,
         "reason": "cheaper capacity"},
        {"ts": t, "type": "preempted", "node": "n2", "zone": "us-east-1a", "state": "preempted"},
        {"ts": t, "type": "node-unresponsive", "node": "n3", "silent_s": 10.2},
        {"ts": t, "type": "capacity-error", "zone": "us-east-1b", "instance_type": "p4d.24xlarge",
         "error": "InsufficientInstanceCapacity: " + "x" * 200},
        {"ts": t, "type": "down", "leaks": []},
    ]


@pytest.mark.parametrize("width", WIDTHS)
def test_events_table_fits_with_readable_columns(width: int) -> None:
    evs = all_event_types()
    rows = cmd_events.event_rows(evs)
    lines = render(fit_table(cmd_events.EVENT_COLS, rows, width), width)
    check_table(lines, width, ["time", "type", "node", "details"], [r[0] for r in rows])
    text = "\n".join(lines)
    assert "{" not in text  # no JSON blobs
    d = {e["type"]: cmd_events.details(e) for e in evs}
    assert d["rescale"] == ("world 8 -> 4, notice, checkpoint step 1200, lost 0 steps, "
                            "pause 4.6s")
    # torchft: no checkpoint is read, the survivors go on from memory
    ft = next(e for e in evs if e["type"] == "rescale") | {"engine": "torchft",
                                                          "notice_to_resume_s": None}
    assert cmd_events.details(ft) == ("world 8 -> 4, notice, in memory from step 1200, "
                                      "lost 0 steps, pause -")
    assert d["notice"].startswith("aws-imds spot terminate, deadline ")
    assert d["notice"].endswith("(in 120s)")
    assert d["drain-committed"] == "gen 3, checkpoint at step 1200"
    assert d["down"] == "clean"


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_prices_table_fits(width: int, provider: str) -> None:
    mod = aws_catalog if provider == "aws" else gcp_catalog
    offers = cmd_prices.sort_offers(mod.load_offers())[:30]
    t = cmd_prices.offers_table(offers, title=f"{provider} spot offers (catalog)", width=width)
    lines = render(t, width)
    check_table(lines, width, [c.short or c.name for c in cmd_prices.PRICE_COLS]
                + [c.name for c in cmd_prices.PRICE_COLS], [o.instance_type for o in offers])
    if width == 120 and provider == "aws":  # every column, every header whole
        for c in cmd_prices.PRICE_COLS:
            assert c.name in "\n".join(lines)


@pytest.mark.parametrize("width", WIDTHS)
def test_cost_and_list_tables_fit(width: int) -> None:
    nodes = [NodeCost(id=f"n{i}", provider="aws", zone="us-east-1a", instance_type="g5.12xlarge",
                      gpus=4, state="preempted", price=1.6234, on_demand_price=5.672,
                      hours=12.345, gpu_hours=49.38, spent_usd=20.0412, on_demand_usd=70.0123,
                      saved_usd=49.9711, running=False) for i in range(1, 4)]
    lines = render(cmd_cost.render(CostReport(cluster="c", now=0.0, nodes=nodes), width=width),
                   width)
    check_table(lines, width, [c.short or c.name for c in cmd_cost.COST_COLS]
                + [c.name for c in cmd_cost.COST_COLS], ["n1", "n2", "n3"])
    rows = [("a-cluster", "local", "running", "3", "2..4"), ("b", "aws", "down", "0", "8..16")]
    lines = render(fit_table(cmd_list.LIST_COLS, rows, width), width)
    check_table(lines, width, [c.name for c in cmd_list.LIST_COLS], ["a-cluster", "b"])


def test_fit_drops_the_least_useful_column_first() -> None:
    cols = (Col("keep"), Col("second", drop=1), Col("first", drop=2))
    rows = [("k" * 20, "s" * 20, "f" * 20)]
    header = render(fit_table(cols, rows, 50), 50)[0]
    assert "keep" in header and "second" in header and "first" not in header
    header = render(fit_table(cols, rows, 30), 30)[0]
    assert header.split() == ["keep"]


@pytest.mark.parametrize("width", WIDTHS)
def test_simulate_table_fits(width: int, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from spotctl.cli import cmd_simulate
    from spotctl.cli.app import app

    monkeypatch.setenv("SPOTCTL_HOME", str(tmp_path))
    res = CliRunner().invoke(app, ["simulate", "--trace",
                                   "aws-1node-04-22-2023-first48h_us-east-1c_v100_1", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    lines = render(cmd_simulate.build_table(data, width), width)
    names = [c.name for c in cmd_simulate.SIM_COLS] + [c.short for c in cmd_simulate.SIM_COLS
                                                       if c.short]
    check_table(lines, width, names, [p["policy"] for p in data["policies"]])
