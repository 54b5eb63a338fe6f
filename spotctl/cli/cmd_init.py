from __future__ import annotations

from pathlib import Path

import typer

from spotctl.errors import SpecError


def register(app: typer.Typer) -> None:
    @app.command()
    def init(
        directory: Path = typer.Argument(Path("."), help="Where to write the files."),
        force: bool = typer.Option(False, "--force", help="Overwrite existing files."),
    ) -> None:
        """Write spotctl.toml and an example elastic train.py (from templates/)."""
        from importlib.resources import files

        directory.mkdir(parents=True, exist_ok=True)
        tpl = files("spotctl") / "templates"
        for name in ("spotctl.toml", "train.py"):
            dest = directory / name
            if dest.exists() and not force:
                raise SpecError(f"{dest} already exists (use --force to overwrite)")
            dest.write_text((tpl / name).read_text())
            print(f"wrote {dest}")
