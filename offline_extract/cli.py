"""What every command shares: -h as well as --help, --version, exit status 130 on Ctrl-C, and warnings as
one line of their own words."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import warnings

import click

from offline_extract.formatting import for_terminal
from offline_extract.lifecycle import interrupts
from offline_extract.version import __version__


class Interrupted(click.ClickException):
    """Ctrl-C, reported with the shell's status for it (128 + SIGINT), so that a wrapping script or
    scheduler sees an interruption rather than a failure, and in words that read as the stop it is, not
    as an error: 'stopped (Ctrl-C)', then what `detail` says of what the command leaves."""

    exit_code = interrupts.INTERRUPTED

    def __init__(self, detail: str = ""):
        super().__init__(f"{interrupts.STOPPED}{detail}")

    def show(self, file=None) -> None:
        click.echo(self.format_message(), err=True, file=file)


# The shell's status for a command stopped by SIGTERM (torchrun stopping the survivors of a failed rank, a
# scheduler preempting the job).
TERMINATED = 128 + signal.SIGTERM


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


class _Command(click.Command):
    as_program = False  # run on sys.argv (`__call__`), where a stop may end the process itself

    # --help's sections: title -> the names of the parameters listed there, in that order; None: one
    # list of every option, as click writes it. Parameters of no section (--version, --help) come last.
    sections: dict[str, tuple[str, ...]] | None = None

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.sections is None:
            return super().format_options(ctx, formatter)
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx)}
        placed = {name for names in self.sections.values() for name in names}
        sections = [*self.sections.items(), ("Other options", tuple(n for n in records if n not in placed))]
        for title, names in sections:
            rows = [row for name in names if (row := records.get(name))]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)

    def __call__(self, *args, **kwargs):
        """Run as the program, on sys.argv, as console scripts and bin/ scripts call it (called with arguments
        of its own, from Python or a test, it is click's `main`, and the caller's process goes on): a stop
        (Ctrl-C, SIGTERM) ends the process with os._exit once its words are out. The command's own cleanup
        has run by then (an extraction's unfinished shard dropped, the complete ones and their journal
        written, the lock released); the interpreter's teardown would only race the threads that the stop
        cut short, still in C code (the tokenizer loading beside the model, the parity reference's read,
        SGLang's and torch's own), and can end the process in SIGSEGV instead of the status a stop has."""
        if args or kwargs:
            return self.main(*args, **kwargs)
        self.as_program = True
        try:
            return self.main()
        except SystemExit as e:
            if e.code in (Interrupted.exit_code, TERMINATED):
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):  # a closed pipe takes nothing more
                        stream.flush()
                os._exit(e.code)
            raise

    def invoke(self, ctx: click.Context):
        # A warning is for the person at the terminal: its words, not Python's file, line and source line.
        warnings.formatwarning = _one_line
        # Ctrl-C from here is taken as `lifecycle.interrupts` says (offline_extract.commands ends it while it imports).
        with interrupts.guard(self.as_program):
            try:
                with interrupts.as_stop(Interrupted, click.exceptions.Exit):
                    return super().invoke(ctx)
            except KeyboardInterrupt:
                raise Interrupted() from None
            except click.ClickException as e:
                # Laid out with the "Error: " that click's `show` puts before it. A stop stays one line, as the
                # README promises.
                if not isinstance(e, Interrupted):
                    # click types message Final, yet nothing of click's reads it before `show`, which lays it out.
                    laid_out = for_terminal(f"Error: {e.message}", sys.stderr).removeprefix("Error:").removeprefix(" ")
                    e.message = laid_out  # type: ignore[misc]
                raise


def command(sections: dict[str, tuple[str, ...]] | None = None, **kwargs):
    """`click.command` for one of our commands; `sections` groups its options in --help (_Command)."""

    def decorate(f):
        f = click.version_option(__version__, "--version", message="%(prog)s, offline_extract %(version)s")(f)
        made = click.command(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]}, **kwargs)(f)
        made.sections = sections
        return made

    return decorate
