#!/usr/bin/env python
"""Does a drafter trained on our states accept as well as one trained on SpecForge's? (issue 36)

\b
The whole pipeline, one step a command, each sized for one device call and resumable:
  prompts                 here, on CPU: training and held-out chat prompts (Python's stdlib docstrings)
  responses               GPU: the target's greedy answers with sglang.Engine (in parts; resumes)
  states VARIANT          GPU: the variant's SpecForge feature files and their view
                          (ours, specforge, offbyone, prenorm, fp8)
  train VARIANT --seed S  GPU: SpecForge 0.2.0's offline EAGLE-3 trainer, then its SGLang export
  serve NAME              GPU: the held-out prompts with the drafter NAME (VARIANT-sSEED) or `target`
  compare A B --json F    anywhere: two variants' files on the records both hold (ids, masks, states)
  table                   anywhere: the JSON and markdown of every measurement so far
  pack DIR                anywhere: DATA's measurements as one .tgz, to bring back from a device call
  drop VARIANT            anywhere: remove a variant's large files from SCRATCH (its drafters stay)
  status                  anywhere: what is done, here and in SCRATCH
A step that is complete is skipped, so rerunning a command after a cut call goes on where it stopped.
DATA (small: prompts, responses, records; carried) and SCRATCH (large, one machine): layout.py.
Device calls, in order, with what each step cost on the H200: benchmarks/drafter/README.md.
"""

from __future__ import annotations

import os
import sys
import tarfile
import time
from pathlib import Path

import click

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import command_line  # noqa: E402
from benchmarks.drafter import layout as lay  # noqa: E402
from benchmarks.drafter.prompts import build, dump_jsonl_gz  # noqa: E402

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    # A CPU run (the tests'): SGLang's scheduler process imports this module again and needs the same setup.
    from offline_extract.engine.sglang_adapter import prepare_process

    prepare_process("cpu")

LAUNCHER = "python benchmarks/drafter/pipeline.py"


@click.group(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--data",
    type=click.Path(file_okay=False, path_type=Path),
    default=lay.DEFAULT_DATA,
    show_default=True,
    help="DATA: what is kept across calls and machines (carried to the GPU machine).",
)
@click.option(
    "--scratch",
    type=click.Path(file_okay=False, path_type=Path),
    default=lay.DEFAULT_SCRATCH,
    show_default=True,
    help="SCRATCH: stores, features, training runs and drafters of this machine.",
)
@click.option(
    "--model",
    type=click.Path(file_okay=False),
    default=None,
    help="The target's model directory (SmolLM2-135M-Instruct converted by the real-model fixture).",
)
@click.option(
    "--device",
    type=click.Choice(["cuda", "cpu"]),
    default="cuda",
    show_default=True,
    help="Where sglang.Engine runs the responses and serve steps; cpu: the tests, on the embedded model.",
)
@click.pass_context
def main(ctx, data, scratch, model, device):
    if device == "cpu":
        from offline_extract.engine.sglang_adapter import prepare_process

        prepare_process("cpu")
    ctx.obj = {
        "layout": lay.Layout(data.resolve(), scratch.resolve()),
        "model": model,
        "start": time.time(),
        "device": device,
    }


def _record(ctx, step: str) -> None:
    """An in-process step's own command, in DATA's command log beside the subprocesses the others run."""
    lay.record_command(ctx.obj["layout"], step, command_line(LAUNCHER).split(), time.time() - ctx.obj["start"], 0)


def _model(ctx) -> str:
    model = ctx.obj["model"]
    if not model:
        raise click.UsageError("this step runs the target: give --model DIR")
    return str(Path(model).resolve())


@main.command(help="Training and held-out prompts into DATA/prompts (here, on CPU; deterministic).")
@click.option(
    "--train",
    default=20480,
    show_default=True,
    help="Training prompts (a multiple of SpecForge's generator batch keeps it from dropping a last incomplete batch).",
)
@click.option("--heldout", default=200, show_default=True, help="Held-out prompts, from other modules.")
@click.pass_context
def prompts(ctx, train, heldout):
    layout = ctx.obj["layout"]
    if lay.is_done(layout.prompts):
        click.echo(f"prompts: complete in {layout.prompts}")
        return
    built = build(train, heldout)
    for name, records in (("train", built.train), ("heldout", built.heldout)):
        data = dump_jsonl_gz(records)
        layout.prompts.mkdir(parents=True, exist_ok=True)
        lay.atomic_write(layout.prompts / f"{name}.jsonl.gz", lambda tmp, data=data: Path(tmp).write_bytes(data))
    lay.mark_done(layout.prompts, **built.source, command=command_line(LAUNCHER))
    click.echo(f"prompts: {len(built.train):,} training and {len(built.heldout)} held-out -> {layout.prompts}")


@main.command(help="The target's greedy responses to the training prompts, with sglang.Engine.")
@click.option("--chunk", default=2048, show_default=True, help="Prompts a part file (one generate call).")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option(
    "--seconds",
    default=480,
    show_default=True,
    help="Start no part after this many seconds of the step (a device call's limit); rerun to go on.",
)
@click.pass_context
def responses(ctx, chunk, max_new_tokens, seconds):
    from benchmarks.drafter.sglang_runs import responses as run

    layout = ctx.obj["layout"]
    if lay.is_done(layout.responses):
        click.echo("responses: complete")
        return
    done = run(
        layout,
        _model(ctx),
        chunk=chunk,
        max_new_tokens=max_new_tokens,
        deadline=ctx.obj["start"] + seconds,
        device=ctx.obj["device"],
    )
    _record(ctx, "responses")
    state = "complete" if lay.is_done(layout.responses) else "not complete: rerun to go on"
    click.echo(f"responses: {done['written']} parts written, {done['kept']} kept, of {done['parts']}; {state}")


@main.command(help="One variant's SpecForge feature files and their view in SCRATCH.")
@click.argument("variant")
@click.option("--max-length", default=2048, show_default=True)
@click.option("--keep-store", is_flag=True, help="Keep our output directory after the export (it is as large).")
@click.option("--specforge-batch-size", default=32, show_default=True)
@click.option("--attention-backend", default="fa3", show_default=True, help="SpecForge's SGLang backend.")
@click.option(
    "--mem-fraction-static",
    type=float,
    default=None,
    help="Our extraction's share of the GPU's memory (default: bin/extract.py's), where drafters train beside it.",
)
@click.pass_context
def states(ctx, variant, max_length, keep_store, specforge_batch_size, attention_backend, mem_fraction_static):
    from benchmarks.drafter.states import states as run

    facts = run(
        ctx.obj["layout"],
        variant,
        _model(ctx),
        max_length=max_length,
        keep_store=keep_store,
        specforge_batch_size=specforge_batch_size,
        attention_backend=attention_backend,
        mem_fraction_static=mem_fraction_static,
    )
    click.echo(
        f"states {variant}: {'complete, skipped' if facts.get('skipped') else 'made'}: "
        f"{facts['view_samples']:,} samples in {ctx.obj['layout'].view(variant)}"
    )


@main.command(help="Train one drafter on a variant's view with SpecForge 0.2.0, and export it for SGLang.")
@click.argument("variant")
@click.option("--seed", required=True, type=int)
@click.option("--steps", default=None, type=int, help="Optimizer steps. Default: one epoch of the view.")
@click.option("--batch-size", default=4, show_default=True)
@click.option("--max-length", default=2048, show_default=True)
@click.option("--learning-rate", default=1e-4, show_default=True)
@click.pass_context
def train(ctx, variant, seed, steps, batch_size, max_length, learning_rate):
    from benchmarks.drafter.train import train as run

    layout = ctx.obj["layout"]
    if steps is None:
        view = layout.view(variant)
        if not lay.is_done(view):
            raise click.ClickException(f"{view} is not complete: run `states {variant}` first (on this machine)")
        steps = lay.read_json(lay.marker(view))["view_samples"] // batch_size
    facts = run(
        layout,
        variant,
        _model(ctx),
        seed=seed,
        steps=steps,
        batch_size=batch_size,
        max_length=max_length,
        learning_rate=learning_rate,
        command=command_line(LAUNCHER),
    )
    click.echo(
        f"train {facts['run']}: {'complete, skipped' if facts.get('skipped') else 'trained'}, "
        f"{facts['steps']} steps -> {layout.drafter(facts['run'])}"
    )


@main.command(help="Serve the held-out prompts with drafter NAME (VARIANT-sSEED), or `target` alone.")
@click.argument("name")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option(
    "--speed-prompts",
    default=16,
    show_default=True,
    help="Prompts served one at a time for tok/s; 0 for none (engines served side by side time nothing alone).",
)
@click.option(
    "--mem-fraction-static",
    type=float,
    default=None,
    help="The engine's share of the GPU's memory (default: SGLang's), to serve several drafters side by side.",
)
@click.pass_context
def serve(ctx, name, max_new_tokens, speed_prompts, mem_fraction_static):
    from benchmarks.drafter.prompts import load_jsonl_gz
    from benchmarks.drafter.sglang_runs import serve as run
    from benchmarks.drafter.table import TARGET
    from benchmarks.drafter.table import trained as trained_as

    layout = ctx.obj["layout"]
    out = layout.serve_record(name)
    drafter = None if name == TARGET else layout.drafter(name)
    here = drafter is not None and lay.is_done(drafter)
    trained = trained_as(lay.read_json(lay.marker(drafter))) if here else None
    if out.exists():
        # A drafter trained again (other --steps) since it was served is served again: the record is of another.
        if not here or lay.read_json(out).get("trained") == trained:
            click.echo(f"serve {name}: complete in {out}")
            return
        click.echo(f"serve {name}: {out} is of a drafter trained otherwise than this one ({trained}); serving it again")
    if drafter is not None and not here:
        raise click.ClickException(f"drafter {name} is not on this machine ({drafter}): run states and train first")
    result = run(
        _model(ctx),
        drafter and str(drafter),
        load_jsonl_gz(layout.prompts / "heldout.jsonl.gz"),
        max_new_tokens=max_new_tokens,
        speed_prompts=speed_prompts,
        log=layout.logs / f"serve_{name}.log",
        device=ctx.obj["device"],
        mem_fraction_static=mem_fraction_static,
    )
    result["command"] = command_line(LAUNCHER)
    result["trained"] = trained
    lay.write_json(out, result)
    _record(ctx, f"serve {name}")
    click.echo(
        f"serve {name}: accept length {result.get('accept_length')}, "
        f"{result['batch1_decode_tok_s'] or 0:.0f} tok/s at batch 1 ({result.get('batch1_prompts')} prompts) -> {out}"
    )


@main.command(help="Variant A's feature files against B's on the records both hold: ids, loss masks, states.")
@click.argument("a")
@click.argument("b")
@click.option("--states-every", default=10, show_default=True, help="Compare the states of every N-th shared record.")
@click.option("--workers", default=8, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.pass_context
def compare(ctx, a, b, states_every, workers, json_path):
    from benchmarks.drafter.compare import compare as run

    tokenizer = None
    if ctx.obj["model"]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(_model(ctx))
    result = run(ctx.obj["layout"], a, b, states_every=states_every, workers=workers, tokenizer=tokenizer)
    result["command"] = command_line(LAUNCHER)
    lay.write_json(json_path, result)
    _record(ctx, f"compare {a} {b}")
    click.echo(
        f"compare {a} {b}: {result['records']:,} records, ids differ in {len(result['ids_differ'])}, stored masks in "
        f"{result['stored_masks_differ']}; trained positions {result['trained_positions']}; -> {json_path}"
    )
    for layer, s in result["states"].items():
        click.echo(
            f"  {layer}: min cosine {s['min_cosine']:.5f} (record, token {s['worst']}), median {s['median_of_medians']:.6f}"
        )


@main.command(help="Every measurement so far as one JSON (--json) and the markdown table.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.pass_context
def table(ctx, json_path):
    from benchmarks.drafter.table import table as make

    try:
        result = make(ctx.obj["layout"])
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    result["command"] = command_line(LAUNCHER)
    if json_path:
        lay.write_json(json_path, result)
    click.echo(result["markdown"])


@main.command(
    help="Pack DATA's responses and records (not the prompts, already here) and SCRATCH's logs into "
    "DIR/drafter-data.tgz."
)
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.pass_context
def pack(ctx, dest):
    layout = ctx.obj["layout"]
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "drafter-data.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for part in ("responses", "train", "serve", "commands.jsonl"):
            if (layout.data / part).exists():
                tar.add(layout.data / part, arcname=part)
        if layout.logs.exists():
            tar.add(layout.logs, arcname="logs")
    click.echo(f"pack: {path} ({path.stat().st_size:,} bytes); unpack here with tar xzf {path.name} -C {layout.data}")


@main.command(help="Remove a variant's store, features and view from SCRATCH (its drafters stay), to make room.")
@click.argument("variant")
@click.pass_context
def drop(ctx, variant):
    import shutil

    layout = ctx.obj["layout"]
    for folder in (layout.store(variant), layout.features(variant), layout.view(variant)):
        if folder.exists():
            shutil.rmtree(folder)
            click.echo(f"drop: removed {folder}")


@main.command(help="What is done in DATA and in SCRATCH.")
@click.pass_context
def status(ctx):
    from benchmarks.drafter.states import VARIANTS

    layout = ctx.obj["layout"]
    rows = [("prompts", lay.is_done(layout.prompts)), ("responses", lay.is_done(layout.responses))]
    rows += [(f"states {v}", lay.is_done(layout.view(v))) for v in VARIANTS]
    rows += [(f"train {p.stem}", True) for p in sorted((layout.data / "train").glob("*.json"))]
    rows += [(f"drafter {p.name} here", lay.is_done(p)) for p in sorted((layout.scratch / "drafters").glob("*"))]
    rows += [(f"serve {p.stem}", True) for p in sorted((layout.data / "serve").glob("*.json"))]
    for what, done in rows:
        click.echo(f"{what}: {'done' if done else 'not done'}")


if __name__ == "__main__":
    main()
