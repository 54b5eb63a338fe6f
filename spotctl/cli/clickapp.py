"""The typer app as a click command, for tools that read click (the docs' CLI reference).

`command` is built from the same `app` the `spotctl` entry point runs, so the reference
cannot drift from the commands and options users get.
"""

from __future__ import annotations

import typer.main

from spotctl.cli.app import app

command = typer.main.get_command(app)
