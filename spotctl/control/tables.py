"""Tables that fit the terminal they are printed on.

A table is declared as columns with a drop rank: when the rows do not fit the width, the
column with the highest rank goes first (rank 0 never goes). Cells never wrap; a column
left too wide for the width is shortened with an ellipsis as the last resort.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class Col:
    name: str
    right: bool = False
    drop: int = 0  # higher goes first when the table is too wide; 0 stays
    short: str | None = None  # a shorter header, tried before dropping anything
    flex: bool = False  # shrinks (with an ellipsis) before any column is dropped


def _measure(t: Table) -> int:
    con = Console(width=10_000, file=io.StringIO(), color_system=None)
    return Measurement.get(con, con.options, t).maximum


def _build(cols: Sequence[Col], keep: list[int], rows: Sequence[Sequence[Any]], short: bool,
           title: str | None, table_box: Any, flex_max: int | None = None,
           caption: str | None = None) -> Table:
    t = Table(title=title, box=table_box, show_edge=False, header_style="bold",
              title_justify="left", caption=caption, caption_justify="left")
    for i in keep:
        c = cols[i]
        t.add_column((c.short or c.name) if short else c.name,
                     justify="right" if c.right else "left", no_wrap=True, overflow="ellipsis",
                     max_width=flex_max if c.flex else None)
    for r in rows:
        t.add_row(*(r[i] for i in keep))
    return t


def _empty(rows: Sequence[Sequence[Any]], i: int) -> bool:
    return all(not str(r[i]).strip() for r in rows)


def fit_table(cols: Sequence[Col], rows: Sequence[Sequence[Any]], width: int,
              title: str | None = None, table_box: Any = box.SIMPLE_HEAD,
              caption: str | None = None) -> Table:
    """The fullest table of `cols` x `rows` no wider than `width` (title and caption wrap
    as text; rows never do)."""
    keep = list(range(len(cols)))
    short = False
    while True:
        t = _build(cols, keep, rows, short, None, table_box)
        over = _measure(t) - width
        if over <= 0:
            return _build(cols, keep, rows, short, title, table_box, None, caption)
        flex = [i for i in keep if cols[i].flex]
        if flex:
            natural = max((Text(str(r[flex[0]])).cell_len for r in rows), default=0)
            room = natural - over
            if room >= max(8, len(cols[flex[0]].name)):
                t = _build(cols, keep, rows, short, None, table_box, flex_max=room)
                if _measure(t) <= width:
                    return _build(cols, keep, rows, short, title, table_box, room, caption)
        if not short and any(c.short for c in cols):
            short = True
            continue
        droppable = [i for i in keep if cols[i].drop > 0]
        if not droppable:
            t = _build(cols, keep, rows, short, title, table_box, None, caption)
            t.width = width  # rich shrinks the widest cells with an ellipsis
            return t
        keep.remove(max(droppable, key=lambda i: (_empty(rows, i), cols[i].drop)))


def fit_line(items: Sequence[Text | str], width: int, sep: str = "  ") -> Text:
    """`items` laid out on as many lines as needed, never breaking an item."""
    out = Text()
    line = 0
    for it in items:
        txt = it if isinstance(it, Text) else Text(it)
        n = txt.cell_len
        if line and line + len(sep) + n > width:
            out.append("\n")
            line = 0
        elif line:
            out.append(sep)
            line += len(sep)
        out.append_text(txt)
        line += n
    return out
