"""`spotctl logs --all [-f]`: every node's log, prefixed, following joins and leaves."""

from __future__ import annotations

from pathlib import Path

from spotctl.cli.cmd_logs import interleave


def test_backlog_then_follow_joins_and_leaves(tmp_path: Path) -> None:
    a, b, c = (tmp_path / f"{n}.log" for n in ("n1", "n2", "n10"))
    a.write_text("a1\na2\na3\n")
    b.write_text("b1\n")
    out: list[str] = []
    polls = {"n": 0}
    ended = {"n2": False}

    def nodes() -> list[tuple[str, Path, bool]]:
        k = polls["n"]
        polls["n"] += 1
        if k == 1:  # n1 writes on, half a line first; n2 writes its last line and goes
            with open(a, "a") as f:
                f.write("a4\na5-par")
            with open(b, "a") as f:
                f.write("b2\n")
            ended["n2"] = True
        if k == 2:
            with open(a, "a") as f:
                f.write("t\n")
            c.write_text("c1\nc2\n")  # n10 joins
        rows = [("n1", a, False), ("n2", b, ended["n2"])]
        return rows + ([("n10", c, False)] if k >= 2 else [])

    interleave(nodes, 2, True, out.append, poll_s=0, stop=lambda: polls["n"] >= 4)
    text = "".join(out).splitlines()
    assert text == [
        "n1 | a2", "n1 | a3",  # the last 2 lines of each log there at the start
        "n2 | b1",
        "n1 | a4",
        "n2 | b2", "n2 | -- left --",
        "n1  | a5-part",  # a line is printed whole, once complete
        "n10 | -- joined --", "n10 | c1", "n10 | c2",  # a joiner's whole log
    ]


def test_without_follow_prints_the_tails_once(tmp_path: Path) -> None:
    a = tmp_path / "a.log"
    a.write_text("x\ny\n")
    out: list[str] = []
    interleave(lambda: [("n1", a, False), ("n2", tmp_path / "none.log", False)], 50, False,
               out.append)
    assert "".join(out) == "n1 | x\nn1 | y\n"
