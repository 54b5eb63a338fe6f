"""The spotctl command line. One module per command (`cmd_*.py`), each with `register(app)`.

Commands parse flags and call one core function; renderers are pure. Typed errors become
one line on stderr and the error's exit code.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import typer

from spotctl.errors import SpotctlError

app = typer.Typer(
    name="spotctl",
    help="Keep elastic PyTorch training alive and progressing on spot VMs.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    pretty_exceptions_enable=False,
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("spotctl")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        print(f"spotctl {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", "-V", help="Print the version and exit.", is_eager=True,
        callback=_print_version,
    ),
) -> None:
    """Keep elastic PyTorch training alive and progressing on spot VMs."""


def _register_commands() -> None:
    import spotctl.cli as pkg

    for mod in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if mod.name.startswith("cmd_"):
            importlib.import_module(f"spotctl.cli.{mod.name}").register(app)


_register_commands()


def main(argv: list[str] | None = None) -> None:
    try:
        if argv is None:
            # a command of its own (not called with arguments from Python): it may join a
            # local cluster's private network, which moves the whole process
            from spotctl.providers.local import private

            private.JOIN = True
            private.join_from_env()
        app(args=argv, standalone_mode=False)
    except SpotctlError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as e:  # click usage errors and the like
        # typer may bundle its own click (typer._click): match by duck type, not class
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            sys.exit(e.exit_code or 2)
        name = type(e).__name__
        if name == "Abort":
            print("aborted", file=sys.stderr)
            sys.exit(1)
        if name == "Exit":
            sys.exit(getattr(e, "exit_code", 0))
        raise

if __name__ == "__main__":
    main()
