"""The states each drafter trains on, as SpecForge's offline feature files, one variant at a time.

    ours       bin/extract.py, then bin/export.py --format specforge (what a user runs)
    specforge  SpecForge 0.2.0's own scripts/prepare_hidden_states.py (the peer bundle's stack)
    offbyone   ours with every aux layer one deeper than the model's default (the seeds' off-by-one)
    prenorm    ours with the pre-norm final state written where SpecForge reads the post-norm one
    fp8        ours with --store fp8, exported to bf16 as SpecForge trains on it
    nvfp4      ours with --store nvfp4 (its final state in fp8, the option's default), exported so too
    nvfp4all   the same with the final state in nvfp4 too (--final-store nvfp4)

Every variant is made from the same corpus file (`corpus.jsonl`: the training prompts with the target's
own responses), which both our reader and SpecForge's read. Each ends in a view, `views/VARIANT/`, of
the same layout whatever made it: `rows_{k}-{k+2000}/data_{j}.ckpt` linking to the variant's file of
corpus record j, so that SpecForge's trainer, which lists and sorts the files, sees the samples in the
same order for every variant (SpecForge's own generator numbers its files in its shuffled order).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from benchmarks.drafter import layout as lay
from benchmarks.drafter.sglang_runs import load_responses, messages
from benchmarks.peers import specforge as peer

VARIANTS = ("ours", "specforge", "offbyone", "prenorm", "fp8", "nvfp4", "nvfp4all")
# Our own variants: the options given to bin/extract.py beyond the common ones.
EXTRACT_OPTIONS = {
    "ours": [],
    "offbyone": None,
    "prenorm": ["--final-state", "pre-norm"],
    "fp8": ["--store", "fp8"],
    "nvfp4": ["--store", "nvfp4"],
    "nvfp4all": ["--store", "nvfp4", "--final-store", "nvfp4"],
}
ROWS_PER_FOLDER = 2000
PEER_SITE = Path("/tmp/peer-site")


def corpus(layout: lay.Layout) -> Path:
    """The training corpus: each training prompt's chat with the target's response as the assistant
    turn. Made from DATA alone, so every machine makes the same file."""
    from benchmarks.drafter.prompts import load_jsonl_gz

    path = layout.corpus
    if path.exists():
        return path
    answers = load_responses(layout)
    lines = []
    for r in load_jsonl_gz(layout.prompts / "train.jsonl.gz"):
        turns = [*r["conversations"], {"from": "gpt", "value": answers[r["id"]]}]
        lines.append(json.dumps({"id": r["id"], "conversations": turns}, ensure_ascii=False) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    lay.atomic_write(path, lambda tmp: Path(tmp).write_text("".join(lines)))
    return path


def specforge_path_of(folder: Path, i: int) -> Path:
    """Sample i's file in SpecForge's layout, as our export and SpecForge's generator name it."""
    from offline_extract.training.export import specforge_path

    return specforge_path(folder, i, ROWS_PER_FOLDER)


def record_index(record_id: str) -> int:
    """The corpus position of a record from its id (`train-000123` is record 123)."""
    return int(record_id.rsplit("-", 1)[1])


def offbyone_layers(num_layers: int) -> list[int]:
    """The default EAGLE-3 layers of a Llama of `num_layers` layers, each one deeper."""
    return [i + 1 for i in peer.capture_layers(num_layers)]


def num_layers(model: str) -> int:
    return json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]


def extract_argv(
    layout: lay.Layout, variant: str, model: str, max_length: int, mem_fraction_static: float | None = None
) -> list[str]:
    options = EXTRACT_OPTIONS[variant]
    if options is None:
        options = ["--layers", ",".join(map(str, offbyone_layers(num_layers(model))))]
    if mem_fraction_static is not None:
        options = [*options, "--mem-fraction-static", str(mem_fraction_static)]
    return [
        lay.python(),
        str(lay.ROOT / "bin" / "extract.py"),
        "--model",
        model,
        "--data",
        str(layout.corpus),
        "--out",
        str(layout.store(variant)),
        "--max-length",
        str(max_length),
        "--no-progress",
        *options,
    ]


def export_argv(layout: lay.Layout, variant: str) -> list[str]:
    # --no-gzip: an fp8 run is gzipped by default; SpecForge then inflates each file whole as it reads it,
    # which changes its speed and nothing it trains on.
    return [
        lay.python(),
        str(lay.ROOT / "bin" / "export.py"),
        str(layout.store(variant)),
        "--to",
        str(layout.features(variant)),
        "--format",
        "specforge",
        "--no-gzip",
        "--no-progress",
    ]


def write_prenorm_as_postnorm(store: Path, dest: Path) -> int:
    """The fault of variant prenorm: every sample of a run extracted with --final-state pre-norm written
    as SpecForge's file with that state under `hidden_state`, where SpecForge expects the post-norm one
    (our export converts it; this writer does not). Files already there are kept. Returns the count."""
    import torch

    from offline_extract.store.atomic import atomic_write
    from offline_extract.training.datasets import HiddenStateDataset
    from offline_extract.training.export import specforge_record

    dataset = HiddenStateDataset(store, verify_checksums=True)
    if dataset.run.final_state != "pre-norm":
        raise RuntimeError(f"{store} holds the {dataset.run.final_state} final state, not the pre-norm one")
    for i in range(len(dataset)):
        path = specforge_path_of(dest, i)
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        record = specforge_record(dataset[i])
        atomic_write(path, lambda tmp, record=record: torch.save(record, tmp), durable=False)
    lay.write_json(
        dest / "export_manifest.json",
        {
            "format": "specforge",
            "fault": "the pre-norm final state under hidden_state, not converted",
            "ids": dataset.ids,
        },
    )
    return len(dataset)


def ours(
    layout: lay.Layout,
    variant: str,
    model: str,
    *,
    max_length: int,
    keep_store: bool,
    mem_fraction_static: float | None = None,
) -> dict:
    """Extract, export (or the prenorm fault's writer), check the files, drop the store."""
    feats = layout.features(variant)
    logs = layout.logs
    facts = {"variant": variant, "extract": extract_argv(layout, variant, model, max_length, mem_fraction_static)}
    facts["extract_s"] = lay.run_logged(
        layout, f"states {variant}: extract", facts["extract"], logs / f"extract_{variant}.log"
    )
    if variant == "prenorm":
        facts["export"] = "benchmarks.drafter.states.write_prenorm_as_postnorm"
        write_prenorm_as_postnorm(layout.store(variant), feats)
    else:
        facts["export"] = export_argv(layout, variant)
        facts["export_s"] = lay.run_logged(
            layout, f"states {variant}: export", facts["export"], logs / f"export_{variant}.log"
        )
    ids = lay.read_json(feats / "export_manifest.json")["ids"]
    files = len(sorted_files(feats))
    if files != len(ids):
        raise RuntimeError(f"{feats} holds {files} feature files for {len(ids)} samples")
    facts.update(samples=len(ids), layers=_run_layers(layout.store(variant)))
    if not keep_store:
        shutil.rmtree(layout.store(variant))
    return facts


def _run_layers(store: Path) -> dict:
    """What the run recorded of the states it holds, for the table to show what each variant trained on."""
    from offline_extract.training.datasets import HiddenStateDataset

    run = HiddenStateDataset(store).run
    return {"layer_ids": list(run.layer_ids), "final_state": run.final_state, "store": run.store}


def sorted_files(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("data_*.ckpt*"))


def specforge_argv(
    layout: lay.Layout, model: str, *, max_length: int, batch_size: int, attention_backend: str
) -> list[str]:
    bundle = lay.ROOT / ".peer-bundle" / "specforge"
    return peer.command(
        bundle / "scripts" / "prepare_hidden_states.py",
        Path(model),
        layout.corpus,
        layout.features("specforge"),
        layout.scratch / "cache" / "specforge",
        max_length=max_length,
        batch_size=batch_size,
        attention_backend=attention_backend,
        draft_config=layout.draft_config,
    )


def specforge(layout: lay.Layout, model: str, *, max_length: int, batch_size: int, attention_backend: str) -> dict:
    """SpecForge's generator on the same corpus, in the peer bundle's site (SGLang 0.5.14); rerun, it
    skips the files it wrote."""
    argv = specforge_argv(
        layout, model, max_length=max_length, batch_size=batch_size, attention_backend=attention_backend
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PEER_SITE), env.get("PYTHONPATH", "")) if p)
    wall = lay.run_logged(layout, "states specforge", argv, layout.logs / "states_specforge.log", env=env)
    return {
        "variant": "specforge",
        "command": argv,
        "wall_s": wall,
        "samples": len(sorted_files(layout.features("specforge"))),
    }


def expected_ids(layout: lay.Layout, tokenizer, max_length: int) -> dict[str, list[int]]:
    """The sha256 of each corpus record's token ids as SpecForge tokenizes it (the chat template rendered
    to text, tokenized without added special tokens, cut at max_length) -> the positions of the records
    with those ids, in corpus order (a corpus can hold the same chat twice; each has a file of its own)."""
    out: dict[str, list[int]] = {}
    with open(layout.corpus) as f:
        for j, line in enumerate(f):
            text = tokenizer.apply_chat_template(
                messages(json.loads(line)), tokenize=False, add_generation_prompt=False
            )
            ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][:max_length], dtype=np.int64)
            out.setdefault(_ids_key(ids), []).append(j)
    return out


def _ids_key(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int64).tobytes()).hexdigest()


def unpadded(ids: np.ndarray) -> np.ndarray:
    """SpecForge's collator right-pads a batch's samples with id 0; a chat of the template ends in its
    end-of-turn marker and newline, never in id 0, so the sample is the ids up to the last non-zero one."""
    nonzero = np.flatnonzero(ids)
    return ids[: int(nonzero[-1]) + 1] if len(nonzero) else ids


def specforge_positions(layout: lay.Layout, model: str, max_length: int) -> tuple[dict[int, str], list[str]]:
    """Each SpecForge file's corpus position, found by its token ids; and the files that match none."""
    import torch
    from transformers import AutoTokenizer

    expected = expected_ids(layout, AutoTokenizer.from_pretrained(model), max_length)
    found, unmatched = {}, []
    for path in sorted_files(layout.features("specforge")):
        ids = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["input_ids"].numpy()
        free = [j for j in expected.get(_ids_key(unpadded(ids)), []) if j not in found]
        if free:
            found[free[0]] = path
        else:
            unmatched.append(path)
    return found, unmatched


def ours_positions(layout: lay.Layout, variant: str) -> dict[int, str]:
    feats = layout.features(variant)
    ids = lay.read_json(feats / "export_manifest.json")["ids"]
    return {record_index(sid): str(specforge_path_of(feats, i)) for i, sid in enumerate(ids)}


def make_view(layout: lay.Layout, variant: str, positions: dict[int, str]) -> int:
    """The variant's files linked under their corpus positions (replacing any earlier view)."""
    view = layout.view(variant)
    if view.exists():
        shutil.rmtree(view)
    for j, target in positions.items():
        link = specforge_path_of(view, j)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link)
    return len(positions)


def states(
    layout: lay.Layout,
    variant: str,
    model: str,
    *,
    max_length: int,
    keep_store: bool,
    specforge_batch_size: int,
    attention_backend: str,
    mem_fraction_static: float | None = None,
) -> dict:
    """One variant's states and view; skipped when its view is complete. `mem_fraction_static`: our
    extraction's share of the GPU, where drafters train beside it."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    view = layout.view(variant)
    if lay.is_done(view):
        return {**lay.read_json(lay.marker(view)), "skipped": True}
    corpus(layout)
    if variant == "specforge":
        from benchmarks.drafter.train import write_draft_config

        write_draft_config(model, layout.draft_config)
        facts = specforge(
            layout, model, max_length=max_length, batch_size=specforge_batch_size, attention_backend=attention_backend
        )
        positions, unmatched = specforge_positions(layout, model, max_length)
        facts["unmatched_files"] = len(unmatched)
    else:
        facts = ours(
            layout,
            variant,
            model,
            max_length=max_length,
            keep_store=keep_store,
            mem_fraction_static=mem_fraction_static,
        )
        positions = ours_positions(layout, variant)
    facts["view_samples"] = make_view(layout, variant, positions)
    lay.mark_done(view, **facts)
    return facts
