"""What every command shares: -h as well as --help, --version, exit status 130 on Ctrl-C, and warnings as
one line of their own words."""
from __future__ import annotations

import signal
import warnings

import click

from offline_extract.version import __version__


class Interrupted(click.ClickException):
    """Ctrl-C, reported with the shell's status for it (128 + SIGINT), so that a wrapping script or
    scheduler sees an interruption rather than a failure."""

    exit_code = 130


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


class _Command(click.Command):
    def invoke(self, ctx: click.Context):
        # A warning is for the person at the terminal: its words, not Python's file, line and source line.
        warnings.formatwarning = _one_line
        # From here Ctrl-C is a KeyboardInterrupt again (offline_extract.commands ends it while it imports).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted("interrupted") from None


def command(**kwargs):
    """`click.command` for one of our commands."""

    def decorate(f):
        f = click.version_option(__version__, "--version", message="%(prog)s, offline_extract %(version)s")(f)
        return click.command(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]}, **kwargs)(f)

    return decorate
