"""Inputs and outputs of the main job as users run it (benchmarks/main_job.sh, benchmarks/model_classes.sh).

python benchmarks/main_job.py corpus MODEL_DIR CORPUS.jsonl --num-tokens N
    a chat corpus (OpenAI `messages`) of the bench's lognormal lengths (mean 1,700 tokens, cap
    8,192), so that the command's samples are the bench's and its figures compare with the bench's;
python benchmarks/main_job.py docstrings CORPUS.jsonl --records N
    real English: the standard library's docstrings, six a record, as text records and as chats in turn
    (about 800 tokens a record with SmolLM2's tokenizer); the same records on every host of one Python version;
python benchmarks/main_job.py stacks ARGS...
    runs `ARGS` (a Python script and its arguments) with every thread's stack sampled every
    $OE_STACKS_EVERY seconds (default 5) into $OE_STACKS, each sample headed by its seconds since the start:
    where a cold start's minute goes, on a machine with no profiler. A sample waits for the GIL, so C code
    that holds it shows as a gap between samples, not as a stack.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path

import click

# Run as a script from anywhere: the checkout's root, for `benchmarks` and the package beside it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@click.group()
def main():
    pass


@main.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("corpus", type=click.Path(dir_okay=False))
@click.option("--num-tokens", default=1_000_000, show_default=True)
def corpus(model_dir, corpus, num_tokens):
    from transformers import AutoTokenizer

    from benchmarks.extraction_vs_prefill import BenchOptions, synthetic_corpus
    from benchmarks.peers.corpus import chat_records
    from offline_extract.data.tokenization import SampleTokenizer

    opts = BenchOptions(num_tokens=num_tokens)
    tokenizer = SampleTokenizer(AutoTokenizer.from_pretrained(model_dir), max_length=opts.longest)
    samples = synthetic_corpus(tokenizer, opts)
    records = chat_records([s.input_ids for s in samples], tokenizer.tokenizer)
    with open(corpus, "w") as f:
        f.writelines(json.dumps({"id": r["id"], "messages": r["conversations"]}) + "\n" for r in records)
    click.echo(f"{len(records)} records, {sum(s.num_tokens for s in samples):,} tokens -> {corpus}")


@main.command()
@click.argument("corpus", type=click.Path(dir_okay=False))
@click.option("--records", default=1500, show_default=True)
def docstrings(corpus, records):
    import importlib
    import warnings

    warnings.simplefilter("ignore")  # importing every standard module warns of the deprecated ones
    docs = []
    for name in sorted(sys.stdlib_module_names):
        # Modules that open windows or print on import.
        if name.startswith("_") or name in ("antigravity", "this", "idlelib", "turtledemo", "tkinter"):
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # a module this platform or build lacks
            continue
        for attr in sorted(dir(module)):
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200:
                docs.append(doc.strip())
    docs = list(dict.fromkeys(docs))
    with open(corpus, "w") as f:
        for i in range(records):
            parts = [docs[(i * 7 + k) % len(docs)] for k in range(6)]
            if i % 2:
                record = {"id": f"doc-{i}", "text": "\n\n".join(parts)}
            else:
                turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": p} for k, p in enumerate(parts)]
                record = {"id": f"chat-{i}", "messages": turns}
            f.write(json.dumps(record) + "\n")
    click.echo(f"{records} records of {len(docs)} docstrings -> {corpus}")


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED, required=True)
def stacks(args):
    # Python's own frames, read under the GIL: faulthandler's watchdog reads them without it, and crashed runs.
    out, every, start = open(os.environ["OE_STACKS"], "a"), float(os.environ.get("OE_STACKS_EVERY", "5")), time.time()

    def sample():
        while True:
            time.sleep(every)
            names = {t.ident: t.name for t in threading.enumerate()}
            lines = [f"Sample at {time.time() - start:.1f} s:"]
            for ident, frame in sys._current_frames().items():
                if ident != threading.get_ident():
                    lines.append(f"Thread {names.get(ident, hex(ident))} (most recent call first):")
                    lines += [
                        f'  File "{f.f_code.co_filename}", line {line} in {f.f_code.co_name}'
                        for f, line in traceback.walk_stack(frame)
                    ]
            out.write("\n".join(lines) + "\n")
            out.flush()

    threading.Thread(target=sample, name="stacks", daemon=True).start()
    script = str(Path(args[0]).resolve())
    sys.argv = [script, *args[1:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
