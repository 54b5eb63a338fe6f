"""The spec reference, generated from spotctl/spec.py: every key of `spotctl.toml` with its
type, default and help. The help is the comment block above a field (or the comment beside
it) in the pydantic models, so the models stay the one place a key is described.

    python -m spotctl.specdoc --check      # exit 1 if docs/reference/spec.md is stale
    python -m spotctl.specdoc --write      # regenerate its generated part (scripts/docs-spec)
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from spotctl.spec import ClusterSpec, GpuRange

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "spec.md"
BEGIN = "<!-- generated from spotctl/spec.py by scripts/docs-spec: edit the models, not this -->"
END = "<!-- end of the generated part -->"


@dataclass(frozen=True)
class Key:
    """One key of the spec as the reference shows it."""

    section: str  # "" (top level), "train", "local.capacity" (an array of tables), ...
    name: str
    type: str  # in words, with the bounds the model enforces
    default: str  # as TOML would write it; "required" when there is none
    help: str  # the field's comment, one line


@cache
def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the comment block right above it, then the comment beside it, joined
    into one line. Only the model's own fields (a subclass' source has only its own)."""
    src = textwrap.dedent(inspect.getsource(model))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, alone on its line)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            alone = not tok.line[: tok.start[1]].strip()
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    cls = ast.parse(src).body[0]
    assert isinstance(cls, ast.ClassDef)
    out: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        beside = [comments[n][0] for n in range(node.lineno, (node.end_lineno or 0) + 1)
                  if n in comments and not comments[n][1]]
        text = " ".join(x for x in above + beside if x)
        if text:
            out[node.target.id] = text[0].upper() + text[1:]
    return out


def _help(model: type[BaseModel], name: str) -> str:
    for cls in model.__mro__:
        if isinstance(cls, type) and issubclass(cls, BaseModel) and name in cls.__dict__.get(
                "__annotations__", {}):
            return field_comments(cls).get(name, "")
    return ""


def _bounds(info: FieldInfo) -> str:
    lo = hi = None
    for m in info.metadata:
        lo = getattr(m, "ge", lo)
        hi = getattr(m, "le", hi)
    if lo is None and hi is None:
        return ""
    def num(x: Any) -> str:
        return f"{x:g}" if isinstance(x, float) else f"{x:,}".replace(",", "_")
    if hi is None:
        return f", at least {num(lo)}"
    if lo is None:
        return f", at most {num(hi)}"
    return f", {num(lo)} to {num(hi)}"


def _type(ann: Any) -> str:
    origin = get_origin(ann)
    if origin is Literal:
        return "one of " + ", ".join(f"`{json.dumps(a)}`" for a in get_args(ann))
    if origin in (list, tuple):
        return f"array of {_type(get_args(ann)[0])}"
    if origin is dict:
        return f"table of {_type(get_args(ann)[1])}"
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a) for a in get_args(ann) if a is not type(None))
    if ann is GpuRange:
        return 'string `"MIN..MAX"` or integer'
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "table"
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names.get(ann, getattr(ann, "__name__", str(ann)))


def _toml(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}" if v.is_integer() else repr(v)
    if isinstance(v, GpuRange):
        return json.dumps(str(v))
    if isinstance(v, BaseModel):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return _toml(info.default_factory())  # type: ignore[call-arg]
    if info.default is PydanticUndefined:
        return "required"
    return _toml(info.default)


def _table_model(ann: Any) -> type[BaseModel] | None:
    """The model of a table (`[train]`) or an array of tables (`[[ssh.hosts]]`)."""
    if get_origin(ann) is list:
        ann = get_args(ann)[0]
    if isinstance(ann, type) and issubclass(ann, BaseModel) and ann is not GpuRange:
        return ann
    return None


def spec_keys(root: type[BaseModel] = ClusterSpec, section: str = "") -> list[Key]:
    """Every key under `root`, scalars first, then each table's keys (depth first)."""
    keys: list[Key] = []
    tables: list[tuple[str, type[BaseModel]]] = []
    for name, info in root.model_fields.items():
        sub = _table_model(info.annotation)
        if sub is not None:
            path = f"{section}.{name}" if section else name
            if get_origin(info.annotation) is list:
                keys.append(Key(section, name, f"array of tables `[[{path}]]`",
                                _default(info), _help(root, name) or _doc(sub)))
            tables.append((path, sub))
            continue
        keys.append(Key(section, name, _type(info.annotation) + _bounds(info), _default(info),
                        _help(root, name)))
    for path, sub in tables:
        keys.extend(spec_keys(sub, path))
    return keys


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")  # <bucket> is no HTML tag


def render(root: type[BaseModel] = ClusterSpec) -> str:
    """The generated part of the page: one table per section."""
    keys = spec_keys(root)
    arrays = {f"{k.section}.{k.name}" if k.section else k.name
              for k in keys if k.type.startswith("array of tables")}
    out: list[str] = []
    for section in dict.fromkeys(k.section for k in keys):
        title = ("Top level" if not section
                 else f"`[[{section}]]`" if section in arrays else f"`[{section}]`")
        out += [f"### {title}", "", "| key | type | default | what |", "|---|---|---|---|"]
        for k in keys:
            if k.section == section:
                default = k.default.replace("|", "\\|")  # a code span: no entities
                out.append(f"| `{k.name}` | {_cell(k.type)} | `{default}` | "
                           f"{_cell(k.help)} |")
        out.append("")
    return "\n".join(out)


def undocumented(root: type[BaseModel] = ClusterSpec) -> list[str]:
    """Keys without help text (a comment in spotctl/spec.py), as section.key."""
    return [f"{k.section}.{k.name}" if k.section else k.name
            for k in spec_keys(root) if not k.help]


def page_with(text: str, generated: str) -> str:
    """`text` (the page) with its generated part replaced."""
    try:
        head, rest = text.split(BEGIN + "\n", 1)
        _, tail = rest.split(END, 1)
    except ValueError:
        raise ValueError(f"{PAGE.name} must hold the markers {BEGIN!r} and {END!r}") from None
    return f"{head}{BEGIN}\n\n{generated}\n{END}{tail}"


def main(argv: list[str]) -> int:
    if argv not in (["--check"], ["--write"]):
        print("usage: python -m spotctl.specdoc --check | --write", file=sys.stderr)
        return 2
    text = PAGE.read_text()
    want = page_with(text, render())
    if argv == ["--write"]:
        if want != text:
            PAGE.write_text(want)
        return 0
    if want != text:
        print(f"{PAGE}: the spec reference is stale; run scripts/docs-spec", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
