from __future__ import annotations

import re
from pathlib import Path

import typer

from spotctl.errors import SpecError
from spotctl.spec import DEFAULT_ENGINE

SCRIPT = "train.py"  # the template's script, and the name it is looked for by first
FALLBACK_NAME = "demo"  # a folder whose name has no letter to start a cluster name with


def register(app: typer.Typer) -> None:
    @app.command()
    def init(
        directory: Path = typer.Argument(Path("."), help="Where to write the files."),
        force: bool = typer.Option(
            False, "--force", help="Overwrite an existing spotctl.toml (a training script "
                                   "already there is always kept)."),
        engine: str = typer.Option(
            DEFAULT_ENGINE, "--engine",
            help="[train] engine: torchft (hot: survivors go on from memory) | torchrun "
                 "(workers restart from a checkpoint at every rescale)."),
        name: str = typer.Option(
            None, "--name", help="Cluster name (default: the folder's name, made valid)."),
    ) -> None:
        """Write spotctl.toml (its cluster named after the folder) and, unless the folder
        has a training script already, an example elastic train.py (from templates/)."""
        from importlib.resources import files

        from spotctl.spec import ENGINES, valid_cluster_name

        if engine not in ENGINES:
            raise SpecError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        cluster = name or cluster_name_for(directory)
        if not valid_cluster_name(cluster):
            raise SpecError(f"--name: {cluster!r} is not a valid cluster name (lowercase "
                            "letters, digits and single '-', starting with a letter, at "
                            "most 40 characters)")
        spec_path = directory / "spotctl.toml"
        if spec_path.exists() and not force:
            raise SpecError(f"{spec_path} already exists (use --force to overwrite)")
        script = existing_script(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tpl = files("spotctl") / "templates"
        text = _with_value((tpl / "spotctl.toml").read_text(), "name", cluster)
        text = _with_value(text, "engine", engine)
        if script is not None:
            text = _with_value(text, "script", script)
        spec_path.write_text(text)
        print(f"wrote {spec_path} (cluster {cluster})")
        if script is None:
            (directory / SCRIPT).write_text((tpl / SCRIPT).read_text())
            print(f"wrote {directory / SCRIPT}")
        else:
            print(f"kept {directory / script}: spotctl.toml runs it ([train] script)")


def cluster_name_for(directory: Path) -> str:
    """A valid cluster name from the folder's name: lowercase, every run of other
    characters one '-', starting with a letter, at most 40 characters."""
    raw = directory.resolve().name.lower()
    name = re.sub(r"[^a-z0-9]+", "-", raw)  # one '-' for each run: never `--`
    name = re.sub(r"^[^a-z]+", "", name)[:40].strip("-")
    return name or FALLBACK_NAME


def existing_script(directory: Path) -> str | None:
    """The training script the folder has already (train.py, else its only .py file):
    the spec runs it and init never writes over it. None: there is none to keep."""
    if (directory / SCRIPT).is_file():
        return SCRIPT
    found = sorted(p.name for p in directory.glob("*.py")) if directory.is_dir() else []
    return found[0] if len(found) == 1 else None


def _with_value(spec: str, key: str, value: str) -> str:
    """The template's spotctl.toml with its first `key = ...` line set to `value` (a
    string), its comment kept in its column."""
    lines = spec.splitlines(keepends=True)
    i = next(i for i, x in enumerate(lines) if x.startswith(f"{key} = "))
    old, sep, comment = lines[i].partition("#")
    width = len(old)
    lines[i] = (f'{key} = "{value}"'.ljust(width) + sep + comment) if sep \
        else f'{key} = "{value}"\n'
    return "".join(lines)
