from __future__ import annotations

import datetime as dt
from typing import Any

import typer

from spotctl.cli.common import NAME_HELP, console, open_store, print_json, resolve_name
from spotctl.control.tables import Col, fit_table

EVENT_COLS = (Col("time"), Col("type"), Col("node", drop=1), Col("details", flex=True))
_SKIP = {"ts", "type", "node", "seq", "id"}


def _clock(ts: Any) -> str:
    try:
        return dt.datetime.fromtimestamp(float(ts)).strftime("%H:%M:%S")
    except (TypeError, ValueError, OverflowError, OSError):
        return "-"


def _s(x: Any) -> str:
    return "-" if x is None else f"{float(x):.1f}s"


def details(e: dict[str, Any]) -> str:
    """One readable line per event type; JSON keeps every field (`--json`)."""
    t = e.get("type")
    g = e.get
    if t == "rescale":
        # torchft: the survivors go on from memory, no checkpoint is read
        at = (f"in memory from step {g('resume_step')}" if g("engine") == "torchft"
              else f"checkpoint step {g('checkpoint_step')}")
        why = g("reason") if g("cause_seen") is not False else f"{g('reason')} (inferred)"
        if g("route") == "plain":  # its own checkpoint: what it redid, only the script knows
            return (f"world {g('from_world_size')} -> {g('to_world_size')}, {why}, plain "
                    f"script, training again after {_s(g('notice_to_resume_s'))}")
        pause = _s(g("notice_to_resume_s"))
        if g("notice_to_resume_s") is None and g("replica_pause_s") is not None:
            pause = f"{_s(g('replica_pause_s'))} (timed by the replicas)"
        return (f"world {g('from_world_size')} -> {g('to_world_size')}, {why}, "
                f"{at}, lost {g('lost_steps')} steps, pause {pause}")
    if t == "pause":  # torchft: the survivors' own timing of a rescale's regroup
        return f"{_s(g('pause_s'))}, timed by the replicas (incarnation {g('incarnation')})"
    if t == "route":
        return str(g("why") or g("route"))
    if t == "regroup":  # torchft: a new quorum of the same replicas (no rescale)
        lost = "?" if g("lost_steps") is None else g("lost_steps")
        return f"world {g('world_size')}, same replicas, {g('reason')}, lost {lost} steps"
    if t == "train-start":
        return f"world {g('world_size')}, from step {g('resume_step')}"
    if t == "notice":
        dl = g("deadline")
        left = f" (in {float(dl) - float(g('received_at') or e['ts']):.0f}s)" if dl else ""
        return (f"{g('source') or '?'} {g('kind') or ''} {g('action') or ''}".strip()
                + (f", deadline {_clock(dl)}{left}" if dl else ", no deadline"))
    if t == "launch":
        price = g("price")
        return (f"{g('instance_type')} in {g('zone')}, {g('gpus')} GPU"
                + (f", ${price:.4f}/h" if price else "") + f": {g('reason')}")
    if t == "preempt-requested":
        return f"{g('style')} notice" + (f", hard stop in {g('in_s'):.0f}s" if g("in_s") else "")
    if t in ("drain-start",):
        return (f"gen {g('gen')}, {g('reason')}: leavers {','.join(g('leavers') or []) or '-'}, "
                f"joiners {','.join(g('joiners') or []) or '-'}")
    if t == "drain-committed":
        return f"gen {g('gen')}, checkpoint at step {g('step')}"
    if t in ("drain-end", "drain-release"):
        return f"gen {g('gen')}: {g('why')}"
    if t == "drain-requested":
        return f"gen {g('gen')}: {', '.join(g('nodes') or [])} ({g('reason')})"
    if t in ("preempted", "node-gone"):
        return f"{g('state')} in {g('zone')}"
    if t == "node-unresponsive":
        return f"silent {_s(g('silent_s'))}"
    if t == "down":
        leaks = g("leaks") or []
        return "clean" if not leaks else f"LEAKS: {leaks}"
    parts = []
    for k, v in e.items():
        if k in _SKIP or v in (None, "", [], {}):
            continue
        if isinstance(v, list):
            v = ",".join(map(str, v))
        elif isinstance(v, float):
            v = f"{v:g}"
        elif isinstance(v, dict):
            continue  # nested detail stays in --json
        parts.append(f"{k} {v}")
    return ", ".join(parts)


def event_rows(rows: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    out = []
    for e in rows:
        node = e.get("node")
        if node is None and e.get("nodes"):
            node = ",".join(map(str, e["nodes"]))
        out.append((_clock(e["ts"]), str(e["type"]), str(node or ""), details(e)))
    return out


def register(app: typer.Typer) -> None:
    @app.command()
    def events(
        name: str | None = typer.Option(None, "--name", help=NAME_HELP),
        type_: str = typer.Option(None, "--type", help="Only events of this type."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """The cluster's events: launches, joins, notices, drains, rescales, down."""
        from spotctl.control.status import events_json

        store = open_store()
        name = resolve_name(store, name)
        rows = events_json(store, name, type_)
        if json_out:
            return print_json(rows)
        con = console()
        table = event_rows(rows)
        width = con.width
        if not con.is_terminal:  # a pipe or a file: every detail whole, however long
            cols = [max([len(c.name)] + [len(r[i]) for r in table])
                    for i, c in enumerate(EVENT_COLS)]
            width = max(width, sum(cols) + 3 * len(cols) + 4)  # cells, padding, edges
            con.width = width
        con.print(fit_table(EVENT_COLS, table, width))
