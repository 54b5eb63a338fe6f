"""The figures of docs/benchmarks.md and the README, rendered from the committed results.

`docs/figures/bench-results.json` holds the measured rows the docs show (`scripts/bench
NAME... --save` replaces the rows of that run, keyed by benchmark and metric) and, under
`runs`, the command, date and machine of each run. `docs/figures/goodput.json` holds the
simulator's goodput table (`scripts/docs-figures --sim` recomputes it). Each figure table
in the docs sits between `<!-- figures:NAME -->` and `<!-- /figures -->`; the prose
around the tables is written by hand. `scripts/docs-figures` checks the docs against
what this module renders; `--write` rewrites them."""

from __future__ import annotations

import difflib
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "figures" / "bench-results.json"
GOODPUT = REPO / "docs" / "figures" / "goodput.json"
DOCS = ("docs/benchmarks.md", "README.md")
TEST = "tests/unit/test_docs_figures.py"

ABOUT = (
    "The measured rows shown in docs/benchmarks.md and the README. `scripts/bench NAME... "
    "--save` replaces the rows of the same benchmark and metric and records its run; "
    "`scripts/docs-figures --write` renders the docs from this file."
)
GOODPUT_ABOUT = (
    "The simulator's goodput table (deterministic), one entry per engine: the command that "
    "prints it, the SimModel overrides, and per trace goodput against the oracle and each "
    "cause's share. `scripts/docs-figures --sim` recomputes it."
)

_MARK_NAME = re.compile(r"<!-- figures:([a-z0-9-]+) -->")
_MARK = re.compile(r"<!-- figures:([a-z0-9-]+) -->\n(.*?)<!-- /figures -->", re.S)


class FiguresError(Exception):
    """The results file or a doc's markers are not what the generator can render."""


# ---------------------------------------------------------------- the results file


def machine() -> dict[str, Any]:
    """This machine as a run record gives it: cores, load average (1, 5, 15 min), torch,
    Python, platform, whether CUDA was there."""
    try:
        import torch

        tv: str | None = torch.__version__
        cuda: bool | None = bool(torch.cuda.is_available())
    except ImportError:
        tv, cuda = None, None
    return {
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch": tv,
        "cuda": cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def read_results(path: Path = RESULTS) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"about": ABOUT, "runs": {}, "rows": []}
    except ValueError as e:
        raise FiguresError(f"{path}: not JSON ({e})") from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("runs"), dict)
        or not isinstance(data.get("rows"), list)
    ):
        raise FiguresError(f"{path}: expected an object with 'runs' (object) and 'rows' (list)")
    for r in data["rows"]:
        for k in ("run", "baseline_run"):
            if (k == "run" or k in r) and r.get(k) not in data["runs"]:
                raise FiguresError(
                    f"{path}: row {r.get('benchmark')!r} / {r.get('metric')!r} names run "
                    f"{r.get(k)!r}, which is not under 'runs'"
                )
    return data


def save(
    rows: Sequence[dict[str, Any]],
    command: str,
    *,
    started: dict[str, Any],
    elapsed_s: float,
    path: Path = RESULTS,
    now: float | None = None,
) -> str:
    """Record one `scripts/bench` run in the results file: its rows (Row.to_json()) replace
    the rows of the same benchmark and metric; failed and skipped rows are left out. Runs
    no row refers to any more are dropped. Returns the run's id."""
    data = read_results(path)
    t = time.gmtime(now if now is not None else time.time())
    finished = time.strftime("%Y-%m-%dT%H:%M:%SZ", t)
    run_id = f"{finished} {command}"
    end = machine()
    mach = {**end, "load_average": {"start": started["load_average"], "end": end["load_average"]}}
    keep = [dict(r, run=run_id) for r in rows if r.get("spotctl") is not None]
    keys = {(r["benchmark"], r["metric"]) for r in keep}
    old = [r for r in data["rows"] if (r["benchmark"], r["metric"]) not in keys]
    data["rows"] = old + keep
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    data["runs"][run_id] = {
        "command": command,
        "commit": sha or None,  # the HEAD the run was made at (uncommitted changes aside)
        "finished_at": finished,
        "elapsed_s": round(elapsed_s, 1),
        "machine": mach,
        "source": "measured",
    }
    used = {r[k] for r in data["rows"] for k in ("run", "baseline_run") if k in r}
    data["runs"] = {k: v for k, v in data["runs"].items() if k in used}
    data["about"] = ABOUT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return run_id


# ---------------------------------------------------------------- numbers


def num(x: float) -> str:
    """A figure as the docs print it: 3 significant digits, thousands with commas."""
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


@dataclass(frozen=True)
class Fig:
    median: float
    min: float | None
    max: float | None
    n: int | None

    @classmethod
    def of(cls, d: dict[str, Any] | None, where: str) -> Fig:
        if d is None:
            raise FiguresError(f"{where}: no value")
        return cls(float(d["median"]), d.get("min"), d.get("max"), d.get("n"))

    @property
    def ranged(self) -> bool:
        return self.min is not None and self.max is not None and self.min != self.max

    def text(self, unit: str = "", noun: str | None = None) -> str:
        """'0.05 s (0.04..0.08, 4 joins)': median, range when known, count when named."""
        extra = [f"{num(self.min)}..{num(self.max)}"] if self.ranged else []  # type: ignore[arg-type]
        if noun and self.n:
            extra.append(f"{self.n} {noun}{'' if self.n == 1 else 's'}")
        u = f" {unit}" if unit else ""
        return num(self.median) + u + (f" ({', '.join(extra)})" if extra else "")


class Results:
    """Rows looked up by benchmark and metric; each lookup remembers its run."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.runs: dict[str, Any] = data["runs"]
        self.rows = {(r["benchmark"], r["metric"]): r for r in data["rows"]}
        self.used: list[str] = []
        self.shown: set[tuple[str, str]] = set()

    def row(self, benchmark: str, metric: str, side: str = "run") -> dict[str, Any]:
        r = self.rows.get((benchmark, metric))
        if r is None:
            raise FiguresError(f"results file: no row {benchmark!r} / {metric!r}")
        run = r.get(side, r["run"])
        self.shown.add((benchmark, metric))
        if run not in self.used:
            self.used.append(run)
        return r

    def ours(self, benchmark: str, metric: str) -> Fig:
        return Fig.of(self.row(benchmark, metric)["spotctl"], f"{benchmark} / {metric}")

    def base(self, benchmark: str, metric: str) -> Fig:
        r = self.row(benchmark, metric, "baseline_run")
        return Fig.of(r["baseline"], f"{benchmark} / {metric} baseline")

    def load(self, benchmark: str, metric: str) -> str:
        return load_text(self.runs[self.row(benchmark, metric)["run"]]["machine"])


def load_text(m: dict[str, Any]) -> str:
    la = m.get("load_average")
    if isinstance(la, str):
        return la
    if isinstance(la, dict):
        ones = [v[0] for v in la.values() if v]
        lo, hi = min(ones), max(ones)
        return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f}"
    return "?"


def _table(head: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    out = [x.replace("|  |", "| |").replace("|  |", "| |") for x in out]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- the tables

FT_DOWN, FT_UP, TR_DOWN, TR_UP = "(4->3)", "(3->4)", "(4->3 nodes)", "(3->4 nodes)"


def t_recovery_ft(r: Results) -> str:
    n = r.ours("recovery", f"torchft: pause at a notice {FT_DOWN}")
    nb = r.base("recovery", f"torchft: pause at a notice {FT_DOWN}")
    k = r.ours("recovery", f"torchft: pause after a hard kill {FT_DOWN}")
    kb = r.base("recovery", f"torchft: pause after a hard kill {FT_DOWN}")
    j = r.ours("join", f"torchft: training pause at a join {FT_UP}")
    jb = r.base("join", f"torchft: training pause at a join {FT_UP}")
    lost = r.ours("lost", "torchft: steps lost per notice")
    return _table(
        ["event", "spotctl, torchft engine", "bare torchft", "steps lost"],
        [
            ["notice", n.text("s", "notice"), nb.text("s") + " (a kill)", num(lost.median)],
            ["join", j.text("s", "join"), jb.text("s"), "0"],
            ["SIGKILL", k.text("s", "kill"), kb.text("s"), "the step in flight"],
        ],
    )


def _pair(a: Fig, b: Fig, each: str) -> str:
    s = f"{num(a.median)} / {num(b.median)}"
    return s + (f" ({each})" if a.n == 1 and b.n == 1 else "")


def t_recovery_torchrun(r: Results) -> str:
    rn, rk = (
        f"notice -> first step at new size {TR_DOWN}",
        f"hard kill -> first step at new size {TR_DOWN}",
    )
    ln = [f"steps lost per notice, checkpoint every {e}" for e in (10, 30)]
    lk = [f"steps lost per hard kill, checkpoint every {e}" for e in (10, 30)]
    jp, jl = f"training pause {TR_UP}", f"steps lost per join {TR_UP}"
    return _table(
        ["benchmark", "metric", "spotctl", "plain torchrun", "unit"],
        [
            ["recovery", "notice -> survivors' first step, local 4->3 nodes",
             r.ours("recovery", rn).text(), r.base("recovery", rn).text(), "s"],
            ["recovery", "hard kill -> survivors' first step, 4->3",
             r.ours("recovery", rk).text(), r.base("recovery", rk).text(), "s"],
            ["lost", "steps lost per notice, checkpoint every 10 / 30",
             _pair(r.ours("lost", ln[0]), r.ours("lost", ln[1]), "one notice each"),
             _pair(r.base("lost", ln[0]), r.base("lost", ln[1]), "one kill each"), "steps"],
            ["lost", "steps lost per hard kill, checkpoint every 10 / 30",
             _pair(r.ours("lost", lk[0]), r.ours("lost", lk[1]), "one kill each"),
             _pair(r.base("lost", lk[0]), r.base("lost", lk[1]), "one kill each"), "steps"],
            ["join", "training pause, 3->4", r.ours("join", jp).text(), r.base("join", jp).text(),
             "s"],
            ["join", "steps lost per join", r.ours("join", jl).text("", "join"),
             r.base("join", jl).text(), "steps"],
        ],
    )  # fmt: skip


def t_quorum(r: Results) -> str:
    w = r.ours("quorum", "torchft: next_step() waiting for its quorum")
    st = "torchft: step time, sync quorum vs bare torchft's async"
    return _table(
        ["metric", "spotctl, torchft engine", "bare torchft"],
        [
            ["`next_step()` wait for the quorum", w.text("ms"), ""],
            ["whole step", r.ours("quorum", st).text("ms"), r.base("quorum", st).text("ms")],
        ],
    )


def t_overhead(r: Results) -> str:
    cpu = "worker CPU per step vs plain DDP"
    same = ", same malloc settings"
    lines = [["plain DDP under torchrun", r.base("overhead", "torchrun: step time vs plain DDP")
              .text("s"), "", "", r.base("overhead", f"torchrun: {cpu}").text("s")],
             ["plain DDP under torchrun, spotctl's malloc settings",
              r.ours("overhead", "plain DDP with spotctl's malloc settings: step time")
              .text("s"), "", "",
              r.ours("overhead", "plain DDP with spotctl's malloc settings: worker CPU per "
                     "step").text("s")]]  # fmt: skip
    for e in ("torchrun", "torchft"):
        lines.append(
            [
                f"{e} engine",
                r.ours("overhead", f"{e}: step time vs plain DDP").text("s"),
                r.ours("overhead", f"{e}: speed as a fraction of plain DDP's").text(),
                r.ours("overhead", f"{e}: speed as a fraction of plain DDP's{same}").text(),
                r.ours("overhead", f"{e}: {cpu}").text("s"),
            ]
        )
    return _table(["", "step time", "plain DDP's step time / this one",
                   "the same, plain with spotctl's malloc settings", "worker CPU per step"],
                  lines)


CKPT_LOOP = (("132 MB", "process"), ("132 MB", "thread"), ("36 MB", "process"), ("36 MB", "thread"))


def t_checkpoint_loop(r: Results) -> str:
    lines = []
    for size, mode in CKPT_LOOP:
        m = f"training loop: blocking per periodic save, {mode} mode ({size})"
        a, s = r.ours("checkpoint", m), r.base("checkpoint", m)
        share = f"{a.median / s.median * 100:.2g} %"
        lines.append([size, mode, a.text("s"), s.text("s"), share, r.load("checkpoint", m)])
    return _table(
        ["state", "mode", "async blocking", "sync save", "share (of the medians)", "load average"],
        lines,
    )


def t_checkpoint_disk(r: Results) -> str:
    rows = [
        ("blocking time per save, 128 MB, async vs sync", "blocking time per save (128 MB)", "s"),
        ("save throughput vs disk write+fsync", "save throughput", "MB/s"),
        ("load throughput vs sequential read (page cache)", "load throughput", "MB/s"),
    ]
    return _table(
        ["metric", "spotctl", "baseline", "unit"],
        [
            [t, r.ours("checkpoint", m).text(), r.base("checkpoint", m).text(), u]
            for t, m, u in rows
        ],
    )


def t_control(r: Results) -> str:
    up, pl, st = (
        "up: launch 64 nodes (moto)",
        "planner: 1,000 nodes x 500 offers",
        "status render: 64 nodes",
    )
    return _table(
        ["metric", "spotctl", "baseline", "unit"],
        [
            ["`up` launch path, 64 nodes vs 64 serial run_instances", r.ours("control", up).text(),
             r.base("control", up).text(), "s"],
            ["planner, 1,000 nodes x 500 offers", r.ours("control", pl).text(), "-", "ms"],
            ["`status` render, 64 nodes (rich table vs json.dumps)", r.ours("control", st).text(),
             r.base("control", st).text(), "ms"],
        ],
    )  # fmt: skip


def t_scale(r: Results) -> str:
    lines = []
    for n in (8, 16, 32, 64):
        q = f"quorum latency, {n} replicas"
        lines.append([str(n), r.ours("scale", q).text(), r.base("scale", q).text(),
                      r.ours("scale", f"GET /api/status, {n} nodes").text(),
                      r.ours("scale", f"head CPU, {n} nodes").text(),
                      r.base("scale", f"head CPU, {n} nodes").text(),
                      r.ours("scale", f"head memory, {n} nodes").text()])
    return _table(["nodes", "quorum (ms), the head", "quorum (ms), bare torchft",
                   "`GET /api/status` (ms)", "head CPU (cores)", "bare Lighthouse CPU (cores)",
                   "head memory (MiB)"], lines)


def t_scale_events(r: Results) -> str:
    m = [("a notice, until `status` shows it", "notice shown in status, 64 nodes", "ms"),
         ("a replacement's first heartbeat, until `status` lists it",
          "replacement shown in status, 64 nodes", "ms"),
         ("the head's memory over the hold (least squares)", "head memory growth, 65 nodes",
          "MiB/h"),
         ("client calls that failed (heartbeats, quorums, notices)", "client calls that failed",
          "calls")]
    return _table(["at 64 nodes", "spotctl", "unit"],
                  [[t, r.ours("scale", k).text(), u] for t, k, u in m])


def t_bootstrap(r: Results) -> str:
    ssh, held, inst = ("bootstrap: 64 nodes over SSH", "bootstrap: 64 nodes vs 8 slots held",
                       "bootstrap: 64 nodes, 10 s installs")  # fmt: skip
    return _table(
        ["bootstrap, 64 nodes", "spotctl (32 SSH slots, heartbeats awaited outside)",
         "8 slots held to heartbeat", "one at a time"],
        [
            ["deps present, all hosts on this machine's 2 cores", r.ours("control", ssh).text(),
             r.base("control", held).text(), r.base("control", ssh).text()],
            ["each host's install takes 10 s on its own side", r.ours("control", inst).text(),
             r.base("control", inst).text(), "-"],
        ],
    )  # fmt: skip


LABELS = {
    "aws-16node-08-27-2023_us-west-2a_v100_1": "aws-16node us-west-2a",
    "aws-1node-04-22-2023-first48h_us-east-1c_v100_1": "aws-1node us-east-1c (48 h)",
    "aws-4node-08-03-2023_us-west-2c_v100_1": "aws-4node us-west-2c",
    "g4dn-trace": "g4dn (bamboo)",
    "p3-trace": "p3 (bamboo)",
}
SYNTH = (("poisson", "Poisson"), ("bursty", "bursty"))
SHARES = ("provisioning", "rescale_pauses", "checkpoints", "reconcile_waits", "lost_steps")


def share(x: float) -> str:
    return "0" if x == 0 else f"{x:.3f}"


def goodput_of(g: dict[str, Any], engine: str, trace: str) -> float:
    for row in g[engine]["rows"]:
        if row["trace"] == trace:
            return float(row["goodput_vs_oracle"])
    raise FiguresError(f"goodput file: no {engine} row for trace {trace!r}")


def t_goodput(g: dict[str, Any]) -> str:
    ft = {x["trace"]: x for x in g["torchft"]["rows"]}
    tr = {x["trace"]: x for x in g["torchrun"]["rows"]}
    lines = []
    for name, x in ft.items():
        if name not in LABELS:
            continue
        lines.append(
            [LABELS[name], str(x["nodes"]), f"{x['goodput_vs_oracle']:.3f}",
             f"{tr[name]['goodput_vs_oracle']:.3f}"]
            + [share(x["gap_share"][k]) for k in SHARES]
            + [share(tr[name]["gap_share"]["lost_steps"])]
        )  # fmt: skip
    for prefix, label in SYNTH:
        names = sorted(n for n in ft if n.startswith(prefix + "-"))
        if not names:
            continue
        seeds = "/".join(n.rsplit("seed", 1)[1] for n in names)

        def mean(d: dict[str, Any], k: str, names: list[str] = names) -> float:
            return sum(d[n]["gap_share"][k] for n in names) / len(names)

        lines.append(
            [f"{label}, {ft[names[0]]['nodes']} nodes, seeds {seeds}", str(ft[names[0]]["nodes"]),
             " / ".join(f"{ft[n]['goodput_vs_oracle']:.3f}" for n in names),
             " / ".join(f"{tr[n]['goodput_vs_oracle']:.3f}" for n in names)]
            + [share(mean(ft, k)) for k in SHARES]
            + [share(mean(tr, "lost_steps"))]
        )  # fmt: skip
    head = ["trace", "nodes", "torchft", "torchrun", "torchft: provisioning", "pauses",
            "checkpoints", "waits", "lost", "torchrun: lost"]  # fmt: skip
    return _table(head, lines)


def run_record(run: dict[str, Any]) -> str:
    """One recorded run as the README names it: command, date, commit, torch, machine load;
    a field the record lacks says so (the older runs were transcribed from the docs)."""
    pub = str(run.get("published") or "").split()
    commit = run.get("commit") or (pub[0] if pub else "commit not recorded")
    date = (run.get("finished_at") or (pub[1] if len(pub) > 1 else "") or "date not recorded")
    m = run.get("machine") or {}
    torch_v = f"torch {m['torch']}" if m.get("torch") else "torch version not recorded"
    la = load_text(m)
    load = "load not recorded" if la in ("?", "not recorded") else f"load {la}"
    return (f"`{run['command']}`, {str(date)[:10]}, {commit}, {torch_v}, "
            f"{m.get('cores', '?')} cores, {load}")


def full_record(run: dict[str, Any]) -> bool:
    """A run recorded by `scripts/bench --save` with all a README figure must name: the
    command, the commit, the date, the torch version and the machine's load (start, end)."""
    m = run.get("machine") or {}
    return bool(run.get("source") == "measured" and run.get("command") and run.get("commit")
                and run.get("finished_at") and m.get("torch") and m.get("cores")
                and isinstance(m.get("load_average"), dict))


# the commands that measure the README rows' cells, each row's in one recorded run
README_RERUN = "scripts/bench recovery lost join --repeat 2 --save"
QUORUM_RERUN = "scripts/bench quorum --save"


def t_readme(r: Results, g: dict[str, Any]) -> str:
    """The README's figures (issue 63): every cell of a row from one recorded run with a full
    record (`full_record`: command, commit, date, torch, load) and its sample count, the run
    numbered below the table. A row whose cells come from several runs, or from a run
    without a full record, is not shown: it is named below the table with the command that
    measures it in one run."""
    fn = f"torchft: pause at a notice {FT_DOWN}"
    fl = "torchft: steps lost per notice"
    tn = f"notice -> first step at new size {TR_DOWN}"
    ln = "steps lost per notice, checkpoint every 10"
    jn = f"torchft: training pause at a join {FT_UP}"
    qn = "torchft: next_step() waiting for its quorum"
    ot, of = "torchrun: step time vs plain DDP", "torchft: step time vs plain DDP"
    runs: list[str] = []  # run ids, numbered in the order the rows name them
    lines: list[list[str]] = []
    missing: dict[str, list[str]] = {}  # the command that measures them -> rows not shown

    def add(label: str, keys: Sequence[tuple[str, str, str]],
            cells: Callable[[], tuple[str, str]], rerun: str = README_RERUN) -> None:
        """The row `label` from the (benchmark, metric, side) cells `keys`, when they all
        come from one run with a full record and each names its sample count; else named
        below the table with `rerun`, the command that measures them in one run."""
        ids, counts = [], []
        for bench, metric, side in keys:
            row = r.row(bench, metric, side)
            ids.append(row.get(side, row["run"]))
            n = (row["spotctl"] if side == "run" else row["baseline"] or {}).get("n")
            counts.append(f"{'' if side == 'run' else 'baseline '}n={n}" if n else "")
        if len(set(ids)) != 1 or not full_record(r.runs[ids[0]]) or not all(counts):
            missing.setdefault(rerun, []).append(label)
            return
        if ids[0] not in runs:
            runs.append(ids[0])
        ours, base = cells()
        lines.append([label, ours, base,
                      f"{runs.index(ids[0]) + 1} ({', '.join(dict.fromkeys(counts))})"])

    add("pause at a notice, torchft engine",
        [("recovery", fn, "run"), ("lost", fl, "run"), ("recovery", fn, "baseline_run")],
        lambda: (f"{num(r.ours('recovery', fn).median)} s, "
                 f"{num(r.ours('lost', fl).median)} steps lost",
                 f"bare torchft: {num(r.base('recovery', fn).median)} s (a kill)"))
    add("pause at a join, torchft engine", [("join", jn, "run"), ("join", jn, "baseline_run")],
        lambda: (f"{num(r.ours('join', jn).median)} s",
                 f"bare torchft: {num(r.base('join', jn).median)} s"))
    add("notice -> survivors' first step, torchrun engine, 4 -> 3 nodes",
        [("recovery", tn, "run"), ("lost", ln, "run"), ("recovery", tn, "baseline_run"),
         ("lost", ln, "baseline_run")],
        lambda: (f"{num(r.ours('recovery', tn).median)} s, "
                 f"{num(r.ours('lost', ln).median)} steps lost",
                 f"plain torchrun: {num(r.base('recovery', tn).median)} s, "
                 f"{num(r.base('lost', ln).median)} steps lost (checkpoint every 10)"))
    add("quorum wait per step, torchft engine, 3 replica groups", [("quorum", qn, "run")],
        lambda: (f"{num(r.ours('quorum', qn).median)} ms", ""), rerun=QUORUM_RERUN)
    add("step time with nothing failing, 2 ranks, MLP 6x2048",
        [("overhead", ot, "run"), ("overhead", of, "run"), ("overhead", ot, "baseline_run")],
        lambda: (f"torchrun engine {num(r.ours('overhead', ot).median)} s, "
                 f"torchft engine {num(r.ours('overhead', of).median)} s",
                 f"plain DDP: {num(r.base('overhead', ot).median)} s"))
    lines.append(
        ["goodput on the p3 spot trace (simulated)",
         f"torchft {goodput_of(g, 'torchft', 'p3-trace'):.3f}, "
         f"torchrun {goodput_of(g, 'torchrun', 'p3-trace'):.3f}", "",
         f"`{g['torchft'].get('command', '?')}`, `{g['torchrun'].get('command', '?')}` "
         f"(deterministic; rerun by {TEST})"])  # fmt: skip
    notes = [f"{i}. {run_record(r.runs[rid])}" for i, rid in enumerate(runs, 1)]
    if missing:
        notes += ["", "Not shown until measured again in one recorded run, on a quiet machine: "
                  + "; ".join(f"{'; '.join(labels)} (`{cmd}`)" for cmd, labels in missing.items())
                  + "."]
    return _table(["", "spotctl", "baseline", "runs (samples)"], lines) + "\n" + "\n".join(
        notes) + "\n"


def _cell(d: dict[str, Any] | None, unit: str = "s") -> str:
    """A figure given as its values ('8.8 and 14.2 s') or as a median ('0.21 s (4 runs)')."""
    if d is None:
        return "-"
    if d.get("values"):
        vs = [num(v) for v in d["values"]]
        return (", ".join(vs[:-1]) + " and " + vs[-1] if len(vs) > 1 else vs[0]) + f" {unit}"
    f = Fig.of(d, "figure")
    return f.text(unit, "run")


def t_ft_partition(r: Results) -> str:
    rows = [
        (
            "network cut, compute-bound step",
            "cut, compute-bound: survivors' first step after the loss",
            "cut, compute-bound: median step",
        ),
        ("network cut, tiny model", "cut, tiny model: survivors' first step after the loss", None),
        (
            "SIGKILL, 3 compute-bound replicas on 2 cores",
            "kill, compute-bound: survivors' first step after the loss",
            "kill, compute-bound: median step",
        ),
    ]
    lines = []
    for label, pause, step in rows:
        p = r.row("ft-partition", pause)
        cmd = f"`{r.runs[p['run']]['command']}`"
        st = _cell(r.row("ft-partition", step)["spotctl"]) if step else "-"
        lines.append([label, cmd, st, _cell(p["spotctl"]), r.load("ft-partition", pause)])
    return _table(["how the node goes", "command", "step", "survivors' pause", "load average"],
                  lines)  # fmt: skip


def t_quorum_stability(r: Results) -> str:
    m = "torchft: spurious regroupings per 1,000 steps, jittery replica"
    row = r.row("quorum", m)
    ours, base = row["spotctl"], row["baseline"]
    hb = row.get("oldest_heartbeat_ms") or {}
    return _table(
        ["one of 3 replicas late to 8 % of its quorums by 0.5-1.5 s",
         "spotctl's defaults (heartbeat timeout 250 ms)", "join timeout 100 ms (the baseline)"],
        [
            ["spurious regroupings per 1,000 steps", _cell(ours, ""), _cell(base, "")],
            ["heals of the late replica", _heals(row, "spotctl"),
             _heals(row, "baseline", " per run")],
            ["oldest heartbeat of a live replica at the Lighthouse",
             ", ".join(f"{num(v)} ms (load {k})" for k, v in hb.items()), ""],
            ["load average", r.load("quorum", m), ""],
        ],
    )  # fmt: skip


def _heals(row: dict[str, Any], side: str, unit: str = "") -> str:
    """The late replica's heals per run on one side ('-' when no session of that side
    finished); a row saved without them is refused in one line."""
    if not isinstance(row.get("heals"), dict):
        raise FiguresError(f"results file: quorum / {row['metric']} has no 'heals' "
                           f"(scripts/bench quorum --save records them)")
    x = row["heals"].get(side)
    return "-" if x is None else num(x) + unit


def t_head_restart(r: Results) -> str:
    m = "torchft: head restart, kill -> 3 replicas committing again"
    row = r.row("chaos", m)
    return _table(
        ["scenario", "kill -> 3 replicas committing again", "steps replayed", "replicas restarted"],
        [["head restart, torchft engine", _cell(row["spotctl"]), num(row["steps_replayed"]),
          num(row["replicas_restarted"])]],
    )  # fmt: skip


def t_filter_cost(r: Results) -> str:
    lines = []
    for label, m in (
        ("median", "per-step quorum of 2 replicas: median"),
        ("90th percentile", "per-step quorum of 2 replicas: 90th percentile"),
    ):
        row = r.row("ft-filter-cost", m)
        lines.append([label, _cell(row["spotctl"], "ms"), _cell(row["baseline"], "ms")])
    return _table(["per-step quorum, 2 replicas", "through the head's filter",
                   "at torchft's own port"], lines)  # fmt: skip


def t_manager_filter_cost(r: Results) -> str:
    lines = []
    for label, m in (
        ("per-step quorum, median", "per-step quorum of 2 workers: median"),
        ("per-step quorum, 90th percentile", "per-step quorum of 2 workers: 90th percentile"),
        ("step time (tiny model), median", "step time, tiny model: median"),
        ("step time (tiny model), 90th percentile", "step time, tiny model: 90th percentile"),
    ):
        row = r.row("ft-filter-cost", f"spanning group's Manager: {m}")
        lines.append([label, _cell(row["spotctl"], "ms"), _cell(row["baseline"], "ms")])
    return _table(["a replica group of 2 workers", "Manager behind the filter",
                   "Manager on loopback (no filter)"], lines)  # fmt: skip


HEAD_ATTACKS = (
    ("slowloris, 300 connections, 1 byte / 2 s, 16 s", "slowloris 300 conns, 1 B/2 s, 16 s"),
    (
        "header flood, 250 connections x 60 headers x 16 KiB, held",
        "header flood 250 conns x 60 headers x 16 KiB",
    ),
)


def _count(x: Any) -> str:
    if isinstance(x, list):
        return f"{num(x[0])}-{num(x[1])}"
    return num(x)


def _latency(x: float) -> str:
    return f"{num(x * 1000)} ms" if x < 0.1 else f"{num(x)} s"


def attack_cell(d: dict[str, Any]) -> str:
    """What one attack got, from tests/security/head_attacks.py's summary of it."""
    held = f"{_count(d['connections_held_at_end'])} held at the end"
    if d.get("oldest_open_s") is not None:
        held += f" (oldest {num(d['oldest_open_s'])} s)"
    if d.get("longest_closed_s") is not None:
        held += f", each closed within {num(d['longest_closed_s'])} s"
    parts = [held]
    if d.get("rss_before_mb") is not None and d.get("rss_peak_mb") is not None:
        parts.append(f"RSS {_count(d['rss_before_mb'])} -> {_count(d['rss_peak_mb'])} MB")
    for what, label in (("status", "`status`"), ("heartbeat", "heartbeats")):
        if d.get(f"{what}_ok") is None:
            continue
        ok, failed = d[f"{what}_ok"], d.get(f"{what}_failed") or 0
        s = f"{label} {ok} of {ok + failed} served"
        lat = [f"median {_latency(d[k])}" for k in (f"{what}_median_s",) if d.get(k) is not None]
        lat += [f"max {_latency(d[k])}" for k in (f"{what}_max_s",) if d.get(k) is not None]
        parts.append(s + (f" ({', '.join(lat)})" if lat else ""))
    return "; ".join(parts)


def t_head_attacks(r: Results) -> str:
    lines = []
    for label, m in HEAD_ATTACKS:
        before = r.row("head-attacks", m, "baseline_run")["baseline"]
        lines.append([label, attack_cell(before), attack_cell(r.row("head-attacks", m)["spotctl"])])
    return _table(["attack", "before (no admission control)", "now"], lines)


# which tests check each table besides the generator's own (docs = results file)
SLOW_CHECKS = {
    "recovery-ft": "`tests/elastic/test_ft_quorum.py` (slow): notice pause < 1 s, kill < 2 s, join "
    "< 2 x its figure (x the run's notice pause over its figure, when slower); "
    "`tests/bench/test_bench_smoke.py` (slow): notice pause over bare torchft's < 2 x the "
    "figures' ratio",
    "recovery-torchrun": "`tests/bench/test_bench_smoke.py` (slow): notice over hard kill < 2 x "
    "the figures' ratio, 0 steps lost at a notice",
    "overhead": "`tests/bench/test_readme_rerun.py` (slow): each engine's step time over plain "
    "DDP's < 2 x the figures' ratio",
    "head-attacks": "`tests/security/test_head_attacks.py` (slow): the same attacks; `status` and "
    "heartbeats served, nothing held after a header flood",
    "goodput": "`tests/unit/test_docs_figures.py` reruns the simulator (the 16-node trace: "
    "`tests/sim/test_goodput_figures.py`, slow)",
}
TITLES = {  # in the page's order
    "recovery-ft": "Rescale pauses: torchft engine",
    "ft-partition": "A node gone without notice (torchft)",
    "recovery-torchrun": "Rescale pauses: torchrun engine",
    "quorum": "The quorum's price",
    "quorum-stability": "Quorum stability",
    "filter-cost": "The Lighthouse filter's cost",
    "manager-filter-cost": "The Manager filter's cost",
    "head-restart": "Head restart",
    "overhead": "Steady-state overhead",
    "checkpoint-loop": "Checkpoints in a training loop",
    "checkpoint-disk": "The Checkpointer against the disk",
    "control": "Control plane",
    "bootstrap": "SSH bootstrap of 64 nodes",
    "scale": "The control plane at 64 nodes",
    "scale-events": "The control plane at 64 nodes: events",
    "goodput": "Goodput on spot traces",
    "goodput-whatif": "Goodput: what if",
    "head-attacks": "The head's API under attack",
}
BENCH_TABLES: dict[str, Callable[[Results], str]] = {
    "recovery-ft": t_recovery_ft,
    "recovery-torchrun": t_recovery_torchrun,
    "quorum": t_quorum,
    "overhead": t_overhead,
    "checkpoint-loop": t_checkpoint_loop,
    "checkpoint-disk": t_checkpoint_disk,
    "control": t_control,
    "bootstrap": t_bootstrap,
    "scale": t_scale,
    "scale-events": t_scale_events,
    "ft-partition": t_ft_partition,
    "quorum-stability": t_quorum_stability,
    "head-restart": t_head_restart,
    "filter-cost": t_filter_cost,
    "manager-filter-cost": t_manager_filter_cost,
    "head-attacks": t_head_attacks,
}


def _when(run: dict[str, Any]) -> str:
    m = run.get("machine", {})
    cores = m.get("cores")
    if run.get("finished_at"):
        parts = [str(run["finished_at"])[:10]]
    else:  # transcribed: when the figures were published ("<commit> <date>")
        parts = [f"published {str(run.get('published', '?')).split()[-1]}"]
    parts.append(f"{cores} cores" if cores else "cores not recorded")
    parts.append(f"load {load_text(m)}")
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    if run.get("source") != "measured":
        parts.append("transcribed")
    return ", ".join(parts)


def t_index(runs: dict[str, dict[str, Any]], used: dict[str, list[str]], g: dict[str, Any]) -> str:
    lines = []
    for name, title in TITLES.items():
        if name == "goodput":
            sims = "<br>".join(f"`{g[e]['command']}`" for e in ("torchft", "torchrun"))
            lines.append([title, sims, "deterministic", SLOW_CHECKS[name]])
            continue
        if name == "goodput-whatif":
            sims = "<br>".join(f"`{v['command']}`" for v in g.get("variants", []))
            lines.append([title, sims, "deterministic", f"`{TEST}` reruns the simulator"])
            continue
        ids = used.get(name, [])
        cmds = "<br>".join(f"`{runs[i]['command']}`" for i in ids)
        when = "<br>".join(_when(runs[i]) for i in ids)
        check = f"`{TEST}` (the table = the results file)"
        if name in SLOW_CHECKS:
            check += "; " + SLOW_CHECKS[name]
        lines.append([title, cmds, when, check])
    return _table(["figures", "command", "run (date, machine)", "checked by"], lines)


def render_tables(results: dict[str, Any], goodput: dict[str, Any]) -> dict[str, str]:
    """Every figure table by marker name."""
    out: dict[str, str] = {}
    used: dict[str, list[str]] = {}
    for name, fn in BENCH_TABLES.items():
        r = Results(results)
        out[name] = fn(r)
        used[name] = r.used
    out["goodput"] = t_goodput(goodput)
    out["goodput-whatif"] = t_goodput_whatif(goodput)
    out["readme"] = t_readme(Results(results), goodput)
    out["index"] = t_index(results["runs"], used, goodput)
    return out


def unshown(results: dict[str, Any]) -> list[str]:
    """The rows of the results file that no table shows ('benchmark / metric'): a run with
    other sizes (`--nodes`, `--checkpoint-mb`) or a row the docs give only in prose."""
    shown: set[tuple[str, str]] = set()
    for fn in BENCH_TABLES.values():
        r = Results(results)
        fn(r)
        shown |= r.shown
    r = Results(results)
    t_readme(r, {e: {"rows": [{"trace": "p3-trace", "goodput_vs_oracle": 0}]} for e in ENGINES})
    shown |= r.shown
    return [f"{b} / {m}" for b, m in Results(results).rows if (b, m) not in shown]


ENGINES = ("torchft", "torchrun")


def render_doc(text: str, tables: dict[str, str], where: str) -> str:
    """`text` with every marked table replaced by its rendering."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in tables:
            raise FiguresError(
                f"{where}: unknown figures marker {name!r} (known: {', '.join(tables)})"
            )
        return f"<!-- figures:{name} -->\n{tables[name]}<!-- /figures -->"

    return _MARK.sub(sub, text)


def read_goodput(path: Path = GOODPUT) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FiguresError(f"{path}: {err}") from None
    for e in ("torchft", "torchrun"):
        if not isinstance(data.get(e), dict) or not isinstance(data[e].get("rows"), list):
            raise FiguresError(f"{path}: expected '{e}' with 'rows'")
    return data


def rendered(repo: Path = REPO) -> dict[str, tuple[str, str]]:
    """Each doc's path -> (its text now, its text as rendered from the results files)."""
    tables = render_tables(
        read_results(repo / RESULTS.relative_to(REPO)),
        read_goodput(repo / GOODPUT.relative_to(REPO)),
    )
    out = {}
    seen: list[str] = []
    for doc in DOCS:
        text = (repo / doc).read_text()
        seen += _MARK_NAME.findall(text)
        out[doc] = (text, render_doc(text, tables, doc))
    missing = [n for n in tables if n not in seen]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if missing or twice:
        raise FiguresError(
            f"figures markers: {', '.join(missing)} missing"
            if missing
            else f"figures markers: {', '.join(twice)} more than once"
        )
    return out


def diff(repo: Path = REPO) -> str:
    """A unified diff of the docs against their rendering; empty when they agree."""
    chunks: list[str] = []
    for doc, (now, want) in rendered(repo).items():
        if now != want:
            chunks += difflib.unified_diff(
                now.splitlines(keepends=True),
                want.splitlines(keepends=True),
                doc,
                doc + " (rendered)",
            )
    return "".join(chunks)


def simulate_goodput(
    settings: dict[str, Any], only: Sequence[str] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Rerun the simulator for each engine of the goodput file with its overrides."""
    from spotctl.simulate.goodput import goodput_rows, model_for

    return {
        e: goodput_rows(model_for(e, settings[e].get("overrides") or {}), only=only, digits=6)
        for e in ("torchft", "torchrun")
    }


def simulate_variants(settings: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Rerun the simulator for each what-if of the goodput file (its engine, overrides,
    blind offers and traces)."""
    from spotctl.simulate.goodput import goodput_rows, model_for

    return [
        goodput_rows(
            model_for(v["engine"], v.get("overrides") or {}),
            blind=bool(v.get("blind")),
            only=v["traces"],
            digits=6,
        )
        for v in settings.get("variants", [])
    ]


WHATIF_TRACES = (
    ("g4dn-trace", "g4dn"),
    ("p3-trace", "p3"),
    ("aws-1node-04-22-2023-first48h_us-east-1c_v100_1", "single node"),
)


def t_goodput_whatif(g: dict[str, Any]) -> str:
    lines = []
    for v in g.get("variants", []):
        got = {r["trace"]: r["goodput_vs_oracle"] for r in v["rows"]}
        lines.append(
            [v["label"], f"`{v['command']}`"]
            + [f"{got[t]:.3f}" if t in got else "-" for t, _ in WHATIF_TRACES]
        )
    return _table(["what if", "command"] + [label for _, label in WHATIF_TRACES], lines)
