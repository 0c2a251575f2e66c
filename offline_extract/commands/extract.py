"""Extract EAGLE-3 training hidden states from a model with SGLang, into safetensors shards.

\b
One GPU, or the embedded tiny model on CPU:
    python bin/extract.py --data corpus.jsonl
A node (data parallel, tensor parallel, or both; any number of nodes with --nnodes):
    torchrun --nproc-per-node 8 bin/extract.py --model /models/Llama-3.1-8B-Instruct --data corpus.jsonl --out /data/hs
    torchrun --nproc-per-node 8 bin/extract.py --model /models/big --tp 4 --data corpus.jsonl --out /data/hs

\b
Input: JSONL (plain or gzip), a .json file of one JSON array, parquet, a datasets.save_to_disk folder
or a hub data set; records (lines, array elements or rows) of any mix of
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}   (ShareGPT)
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]} (OpenAI)
    {"text": ...}                                     (plain text, every token in the loss)
    {"input_ids": [...], "loss_mask": [...]}          (pre-tokenized; loss_mask optional)
with an optional "id". OpenAI content may be a list of {"type": "text", "text": ...} parts (joined
with newlines). Chats are rendered with the model's own chat template; the loss mask covers assistant
tokens only. Bad records go to OUT/rejects.jsonl with source, line (element, row) and reason; the run goes
on (--strict: it stops at the first).

\b
Output: OUT/shard_NNN.safetensors holding input_ids, loss_mask, aux_hidden_states [T, k*H],
hidden_states [T, H] (the final state, after the final norm unless --final-state pre-norm), offsets
and sample_index; OUT/index.json lists them, OUT/manifest.json records the run's identity and every
shard's checksum.
Layer id k is the output of decoder layer k, i.e. HF output_hidden_states[k+1].

\b
Re-running the same command into the same --out resumes: samples in complete shards are kept, the rest
are extracted (on any number of GPUs). A run that stopped (crash, full disk) loses at most the shards
it was writing.
"""

import contextlib
import dataclasses
import math
import os
import shlex
import signal
import sys
import typing
from pathlib import Path

import click

from offline_extract.cli import TERMINATED, Interrupted, command
from offline_extract.formatting import for_terminal
from offline_extract.lifecycle import interrupts, startup_gc
from offline_extract.options import GROUPS, ExtractOptions, RunOptions, choices, is_choice


def _comma_separated(ctx, param, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",")) if value.strip() else ()
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers, got {value!r}", param_hint=param.opts[0]
        ) from None


class _Finite:
    """A float option's type that refuses nan and inf, which Python's float() reads and no size, fraction or
    interval is."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class _FiniteFloat(_Finite, click.types.FloatParamType):
    pass


class _FiniteFloatRange(_Finite, click.FloatRange):
    pass


def _in_units(unit: int):
    return lambda ctx, param, value: int(value * unit)


def _option(f: dataclasses.Field):
    """click.option of the ExtractOptions field `f`, as its Cli metadata, type and default say."""
    cli, hint = f.metadata["cli"], typing.get_type_hints(ExtractOptions)[f.name]
    flag = cli.flag or f"--{'no-' if cli.inverse else ''}{f.name.replace('_', '-')}"
    given = {"help": cli.help, "default": None if f.default is dataclasses.MISSING else f.default}
    types = set(typing.get_args(hint)) or {hint}
    if hint is bool:
        given.update(is_flag=True, flag_value=not cli.inverse)
    elif is_choice(f.name):
        given["type"] = click.Choice(choices(f.name))
    elif hint == tuple[str, ...]:
        given.update(multiple=True, required=True)
    elif tuple[int, ...] in types:
        given["callback"] = _comma_separated
    elif cli.directory:
        given["type"] = click.Path(file_okay=False)
    elif types & {int, float}:
        number = float if float in types or cli.unit != 1 else int
        if cli.minimum is None:
            given["type"] = _FiniteFloat() if number is float else int
        else:
            ranged = _FiniteFloatRange if number is float else click.IntRange
            given["type"] = ranged(cli.minimum, min_open=not cli.minimum_taken)
        if cli.unit != 1:
            given.update(default=f.default / cli.unit, callback=_in_units(cli.unit))
    given["show_default"] = given["default"] is not None and hint is not bool
    return click.option(flag, f.name, **given)


def _options(function):
    """`function` taking every ExtractOptions field as an option, in the fields' order."""
    for f in reversed(dataclasses.fields(ExtractOptions)):
        function = _option(f)(function)
    return function


def extract_option(name: str):
    """click.option of the ExtractOptions field `name`, as this command takes it: for another command that takes
    the same option (bin/bench.py), so that its help, type, bounds and default are stated once."""
    (f,) = (f for f in dataclasses.fields(ExtractOptions) if f.name == name)
    return _option(f)


# --help's sections (options.GROUPS), each with its options: its group's fields, and --dry-run's.
SECTIONS = {
    title: (*(f.name for f in dataclasses.fields(group)), *(("dry_run",) if group is RunOptions else ()))
    for group, title in GROUPS.items()
}


@command(help=__doc__, sections=SECTIONS)
@_options
@click.option(
    "--dry-run",
    is_flag=True,
    help="Tokenize the corpus, print samples, tokens, the first rejected records (line and reason), bytes "
    "per output tensor and free space at --out, and stop; exits non-zero if the output would not fit "
    "(unless --force), --out cannot be written, or another extraction is running into --out (it names "
    "it, as the run would). It writes nothing into --out.",
)
def main(dry_run, **options):
    out = options["out"]
    existed = os.path.lexists(out)
    # Until the run writes into --out (output.OutputDirectory.claim), a stop leaves nothing to clean up but the --out
    # it made.
    interrupts.at_once(f"{interrupts.STOPPED}{_left_by_a_dry_run(out, existed) if dry_run else _nothing_written(out)}")
    if not (existed or dry_run):
        interrupts.undo_at_once(lambda: _remove_if_empty(out))
    # No full garbage collection until the model is loaded (extraction.Job._load); a dry run loads none.
    with contextlib.nullcontext() if dry_run else startup_gc.start_up():
        # Here, not at the top: torch and transformers take seconds to import, which --help, --version and a
        # mistyped option need not wait for.
        from offline_extract.lifecycle.timeline import mark_process

        # torch first, and timed: SGLang cannot run without it, so its import is SGLang's share of the start-up
        # (timings.run_timings), not ours.
        mark_process("importing torch")
        import torch  # noqa: F401

        mark_process("torch imported")
        from offline_extract.extraction import raise_terminated

        opts = ExtractOptions(**options)
        # Torchrun stops every rank with SIGTERM once one fails, and schedulers preempt with it: stop as on an
        # error (the unfinished shard dropped, the lock released) instead of dying mid-write.
        signal.signal(signal.SIGTERM, raise_terminated)
        result = _run(opts, dry_run, existed)
    if dry_run:
        _refuse_by_the_plan(opts, result)
    elif result is not None:
        _report(opts, result)


def _run(opts: ExtractOptions, dry_run: bool, existed: bool):
    """The dry run's plan, or the run's summary (None on every rank but the leader's); a failure ends the
    command with its message, a stop saying what it leaves in --out (which `existed` before the command, or not)."""
    from offline_extract import extraction
    from offline_extract.engine.distributed import LeaderFailed, PeerLost, ReportedByLeader
    from offline_extract.engine.parity import ParityError
    from offline_extract.extraction import Terminated
    from offline_extract.output import StoppedError

    try:
        with interrupts.as_stop():
            return extraction.dry_run(opts) if dry_run else extraction.run(opts)
    except (OSError, ValueError, NotImplementedError, ParityError, StoppedError, LeaderFailed, PeerLost) as e:
        # Bad input, a failed check or a full disk: the message names it; a traceback would only bury it.
        raise click.ClickException(str(e)) from e
    except ReportedByLeader:
        sys.exit(1)  # rank 0 printed why, once for the whole run
    except KeyboardInterrupt:
        raise Interrupted(_left(opts, existed, dry_run)) from None
    except Terminated:
        if "RANK" in os.environ:
            stopped = (
                f"rank {os.environ['RANK']}: stopped by SIGTERM (torchrun sends it to every rank once one fails, "
                f"and its report names that one)"
            )
        else:  # sent by whatever stops this process: a scheduler, a time limit, kill
            stopped = f"{'dry run' if dry_run else 'extraction'}: stopped by SIGTERM"
        click.echo(f"{stopped}{_left(opts, existed, dry_run)}", err=True)
        sys.exit(TERMINATED)


def _left(opts: ExtractOptions, existed: bool, dry_run: bool) -> str:
    """What a stop leaves in --out, said as it is: a directory that this run made and left empty goes."""
    from offline_extract.formatting import plural
    from offline_extract.store.index import shard_paths
    from offline_extract.store.resume import to_resume

    out = opts.out
    if dry_run:
        return _left_by_a_dry_run(out, existed)
    shards = shard_paths(Path(out)) if os.path.isdir(out) else []
    if shards:
        return (
            f"; the {plural(len(shards), 'complete shard')} in {out} {'are' if len(shards) > 1 else 'is'} "
            f"kept, and {to_resume(opts.data)}"
        )
    if not existed:
        _remove_if_empty(out)
    return _nothing_written(out) if not os.path.lexists(out) else f" before any shard was written to {out}"


def _refuse_by_the_plan(opts: ExtractOptions, plan) -> None:
    """The dry run's plan printed; the command fails where the real run would (or would not fit, unless --force)."""
    from offline_extract import planning
    from offline_extract.summary import no_sample_verdict

    out = opts.out
    click.echo(planning.render(plan, out))
    verdict = no_sample_verdict(opts.data, plan.records, {"rejected": plan.rejected, "skipped": plan.skipped})
    if verdict:
        raise click.ClickException(verdict)
    if not plan.writable:
        raise click.ClickException(f"{out} cannot be written: its filesystem is read-only, or you lack permission")
    if plan.in_use:
        raise click.ClickException(plan.in_use)
    refusal = plan.refusal(out)
    if refusal and not opts.force:
        raise click.ClickException(refusal)


def _report(opts: ExtractOptions, summary) -> None:
    """The leader's report of the run; the command fails where it extracted no sample."""
    from offline_extract.store.schema import REJECTS_FILE

    click.echo(summary.report(opts.out), err=True)
    verdict = summary.no_sample_verdict(opts.data)
    if verdict:
        # The manifest says complete (with these counts): re-running would only repeat this verdict.
        raise click.ClickException(f"{verdict}, see {Path(opts.out) / REJECTS_FILE}" if summary.records else verdict)
    click.echo(for_terminal(_next_steps(opts.out), sys.stderr), err=True)


def _next_steps(out: str) -> str:
    """What to do with a finished output, in the commands as this one was run (a checkout's bin/ scripts, or
    the installed commands), ready to paste."""
    given = os.path.normpath(out)
    inspect = f"{_sibling('inspect')} {shlex.quote(given)}"
    export = f"{_sibling('export')} --format specforge {shlex.quote(given)} --to {shlex.quote(given + '-specforge')}"
    return (
        f"next: {inspect}  (a summary; --sample ID shows one sample, --verify checks every shard)\n"
        f"      {export}  (a trainer's layout; or --format speculators)"
    )


def _sibling(name: str) -> str:
    """The command `name` (inspect, export) as this one was run: the bin/ script beside this one's, or the
    installed command (setup.cfg's console scripts)."""
    script = sys.argv[0]
    if script.endswith(".py") and os.path.basename(os.path.dirname(os.path.abspath(script))) == "bin":
        return f"python {shlex.quote(os.path.join(os.path.dirname(script), f'{name}.py'))}"
    return f"offline-extract-{name}"


def _remove_if_empty(out: str) -> None:
    """--out, which this command made, removed where the stop leaves it empty."""
    with contextlib.suppress(OSError):  # not empty: it holds what the run wrote, or another's files
        os.rmdir(out)


def _nothing_written(out: str) -> str:
    return f" before anything was written to {out}"


def _left_by_a_dry_run(out: str, existed: bool) -> str:
    return f"; a dry run writes nothing{f', so {out} is as it was' if existed else ''}"
