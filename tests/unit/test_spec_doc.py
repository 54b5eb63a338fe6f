"""docs/reference/spec.md's key tables are generated from the models in spotctl/spec.py
(spotctl.specdoc): the page must equal what the models render, every key must carry help
(its comment in spec.py), and the example on the page must be a spec that validates."""

from __future__ import annotations

import re
from typing import get_origin

import pytest
from pydantic import BaseModel, Field

from spotctl import spec, specdoc
from spotctl.spec import load_spec


def test_the_spec_page_is_what_the_models_render() -> None:
    text = specdoc.PAGE.read_text()
    assert text == specdoc.page_with(text, specdoc.render()), (
        "docs/reference/spec.md differs from spotctl/spec.py: run scripts/docs-spec")
    assert specdoc.main(["--check"]) == 0


def test_every_key_of_the_spec_has_help() -> None:
    assert specdoc.undocumented() == [], (
        "give these fields a comment in spotctl/spec.py (above or beside them)")


def test_every_field_of_every_model_is_on_the_page() -> None:
    text = specdoc.PAGE.read_text()

    def walk(model: type[BaseModel], path: str) -> list[str]:
        """Every key as section.key; a table (`[train]`) is a section, not a key."""
        out = []
        for name, info in model.model_fields.items():
            sub = specdoc._table_model(info.annotation)
            here = f"{path}.{name}" if path else name
            if sub is None or get_origin(info.annotation) is list:
                out.append(here)
            if sub is not None:
                assert f"### `[{here}]`" in text or f"### `[[{here}]]`" in text, here
                out += walk(sub, here)
        return out

    keys = walk(spec.ClusterSpec, "")
    assert len(keys) >= 60, keys
    rows = {(k.section, k.name) for k in specdoc.spec_keys()}
    for k in keys:
        section, _, name = k.rpartition(".")
        assert (section, name) in rows, k
        assert f"| `{name}` |" in text, k


class _Inner(BaseModel):
    """A nested table."""

    depth: int = Field(default=2, ge=0, le=9)  # how deep


class _Grown(BaseModel):
    # an old key
    old: str = "x"
    # a key added later: its comment
    # spans two lines
    added: list[str] = Field(default_factory=lambda: ["a"])  # and one beside it
    mode: bool = False
    inner: list[_Inner] = Field(default_factory=list)


def test_a_key_added_to_a_model_changes_the_page() -> None:
    keys = {(k.section, k.name): k for k in specdoc.spec_keys(_Grown)}
    added = keys[("", "added")]
    assert added.help == "A key added later: its comment spans two lines and one beside it"
    assert (added.type, added.default) == ("array of string", '["a"]')
    assert keys[("", "mode")].help == ""
    assert specdoc.undocumented(_Grown) == ["mode"]
    assert keys[("", "inner")].help == "A nested table."
    depth = keys[("inner", "depth")]
    assert (depth.type, depth.default, depth.help) == ("integer, 0 to 9", "2", "How deep")
    page = specdoc.render(_Grown)
    assert "### `[[inner]]`" in page and "| `added` |" in page
    # a page rendered before the key existed is stale
    older = specdoc.render(_Inner)
    doc = f"intro\n{specdoc.BEGIN}\n\n{older}\n{specdoc.END}\nrest\n"
    assert specdoc.page_with(doc, page) != doc
    assert specdoc.page_with(doc, older) == doc


def test_a_page_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="must hold the markers"):
        specdoc.page_with("no markers here", "x")
    assert specdoc.main(["--nope"]) == 2


def test_the_example_on_the_page_is_a_valid_spec(tmp_path) -> None:
    text = specdoc.PAGE.read_text()
    example = re.search(r"```toml\n(.*?)```", text, re.S)
    assert example
    (tmp_path / "spotctl.toml").write_text(example.group(1))
    s = load_spec(tmp_path / "spotctl.toml", check_script=False)
    assert (s.name, str(s.gpus), len(s.local.capacity)) == ("demo", "2..4", 2)
