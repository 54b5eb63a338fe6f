from __future__ import annotations

from pathlib import Path

import typer

from spotctl.errors import SpecError
from spotctl.spec import DEFAULT_ENGINE


def register(app: typer.Typer) -> None:
    @app.command()
    def init(
        directory: Path = typer.Argument(Path("."), help="Where to write the files."),
        force: bool = typer.Option(False, "--force", help="Overwrite existing files."),
        engine: str = typer.Option(
            DEFAULT_ENGINE, "--engine",
            help="[train] engine: torchft (hot: survivors go on from memory) | torchrun "
                 "(workers restart from a checkpoint at every rescale)."),
    ) -> None:
        """Write spotctl.toml and an example elastic train.py (from templates/)."""
        from importlib.resources import files

        from spotctl.spec import ENGINES

        if engine not in ENGINES:
            raise SpecError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        directory.mkdir(parents=True, exist_ok=True)
        tpl = files("spotctl") / "templates"
        for name in ("spotctl.toml", "train.py"):
            dest = directory / name
            if dest.exists() and not force:
                raise SpecError(f"{dest} already exists (use --force to overwrite)")
            text = (tpl / name).read_text()
            if name == "spotctl.toml":
                text = _with_engine(text, engine)
            dest.write_text(text)
            print(f"wrote {dest}")


def _with_engine(spec: str, engine: str) -> str:
    """The template's spotctl.toml with its `[train] engine` line set to `engine`."""
    lines = spec.splitlines(keepends=True)
    i = next(i for i, x in enumerate(lines) if x.startswith("engine = "))
    value, sep, comment = lines[i].partition("#")
    width = len(value)
    lines[i] = f'engine = "{engine}"'.ljust(width) + sep + comment
    return "".join(lines)
