"""The README and the docs pages: short README, and every `spotctl ...` command they show
is one the real CLI accepts (parsed by the click command the entry point runs, nothing
executed)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from spotctl.cli.clickapp import command

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# eager root options whose callbacks act (install a completion script): checked by name only
ACTING = {"--install-completion", "--show-completion"}


def code_lines(text: str) -> list[str]:
    """Lines of fenced code blocks and of indented blocks (after a blank line, not in a
    fence)."""
    out: list[str] = []
    fence = ""
    indented = False
    prev_blank = True
    for line in text.splitlines():
        stripped = line.strip()
        m = re.match(r"\s*(```+|~~~+)", line)
        if fence:
            if m and stripped.startswith(fence) and stripped.strip(fence[0]) == "":
                fence = ""
            else:
                out.append(line)
        elif m:
            fence = m.group(1)
        elif line.startswith("    ") and (prev_blank or indented):
            indented = True
            out.append(line)
        else:
            indented = False
        prev_blank = not stripped
    return out


def spotctl_commands(text: str) -> list[list[str]]:
    cmds = []
    for line in code_lines(text):
        s = line.strip()
        s = s[2:] if s.startswith("$ ") else s
        if s.startswith("spotctl "):
            cmds.append(shlex.split(s, comments=True)[1:])
    return cmds


def parse(argv: list[str]) -> Any:
    """Resolve subcommands and parse every option and argument like the real CLI, without
    invoking anything. Raises click's usage errors (unknown command or option, a missing
    or invalid value)."""
    if ACTING & set(argv):
        names = {o for p in command.params for o in p.opts}
        assert ACTING & set(argv) <= names, argv
        return None
    cmd, name, args, ctx = command, "spotctl", list(argv), None
    while True:
        ctx = cmd.make_context(name, args, parent=ctx, resilient_parsing=False)
        if not hasattr(cmd, "resolve_command"):
            return ctx
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        assert rest, f"{argv}: a command group without a subcommand"
        name, cmd, args = cmd.resolve_command(ctx, rest)
        assert cmd is not None and name is not None, argv


def test_readme_fits_one_screenful_of_scrolling() -> None:
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines; detail belongs in docs/"


def test_code_blocks_are_found() -> None:
    text = "x\n\n    spotctl a  # c\n\n```bash\nspotctl b --x\n```\n```\nnot\n```\n"
    assert spotctl_commands(text) == [["a"], ["b", "--x"]]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_shown_is_a_valid_invocation(page: Path) -> None:
    for argv in spotctl_commands(page.read_text()):
        try:
            parse(argv)
        except Exception as e:  # click's usage errors: typer bundles its own click classes
            if type(e).__name__ == "Exit" and getattr(e, "exit_code", 1) == 0:
                continue  # --version, --help: valid, and they stop there
            msg = e.format_message() if hasattr(e, "format_message") else repr(e)
            pytest.fail(f"{page.name}: `spotctl {shlex.join(argv)}`: {msg}")


def test_the_parser_refuses_what_the_cli_refuses() -> None:
    parse(["cron", "install", "--every", "5m"])
    parse(["logs", "--all", "-f"])
    for bad in (["nope"], ["up", "--gpu", "2"], ["preempt"], ["status", "--interval", "x"]):
        with pytest.raises(Exception) as e:
            parse(bad)
        assert getattr(e.value, "exit_code", None) == 2, (bad, e.value)  # a usage error
    with pytest.raises(Exception) as e:
        parse(["cron"])  # a group alone shows its help: not an example of a command
    assert "NoArgsIsHelp" in type(e.value).__name__ or "subcommand" in str(e.value), e.value


def test_the_readme_and_every_page_show_commands() -> None:
    assert len(spotctl_commands((REPO / "README.md").read_text())) >= 10
    shown = [c[0] for p in PAGES for c in spotctl_commands(p.read_text()) if c]
    groups: dict[str, Any] = getattr(command, "commands", {})
    visible = {n for n, c in groups.items() if not c.hidden}
    # every user-facing command appears in some example
    assert visible <= set(shown), sorted(visible - set(shown))


def test_readme_links_point_at_files_that_exist() -> None:
    """mkdocs --strict checks the pages' links; the README is outside the site."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [x for x in links if "://" not in x]
    assert len(local) >= 10, local
    missing = [x for x in local if not (REPO / x).exists()]
    assert not missing, missing
