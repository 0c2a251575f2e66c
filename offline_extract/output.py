"""The output directory as one rank's run sees it: claimed for this run once the model has loaded (`claim`), and
described whole by the leader once every replica has written (`finish`: rejects.jsonl, the index, and last the
manifest); or found already complete (`already_complete`). A failure a re-run recovers from says so
(`resumable`, `StoppedError`).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from offline_extract.data.sources import CorpusReadError, Source
from offline_extract.engine.distributed import Coordinator, Layout
from offline_extract.engine.nonfinite import NonFiniteError
from offline_extract.formatting import plural
from offline_extract.lifecycle import interrupts
from offline_extract.lifecycle.progress import note
from offline_extract.lifecycle.timeline import Timeline
from offline_extract.lifecycle.timings import timing_line
from offline_extract.options import ExtractOptions
from offline_extract.store import manifest, resume
from offline_extract.store.atomic import atomic_write
from offline_extract.store.index import write_index
from offline_extract.store.journal import read_journal, replicas_files
from offline_extract.store.schema import REJECTS_FILE, RunInfo
from offline_extract.summary import Summary


class StoppedError(RuntimeError):
    """The run stopped part-way (disk full, I/O error, non-finite states); what it wrote is complete."""


@contextmanager
def resumable(out: Path, data: Sequence[str]) -> Iterator[None]:
    """Turns a failure that a re-run of the corpus `data` (the --data entries) recovers from into a StoppedError that
    says so."""
    try:
        yield
    except (OSError, NonFiniteError) as e:
        raise StoppedError(
            f"{e}\nThe complete shards in {out} are kept: once the cause is fixed, {resume.to_resume(data)}."
        ) from e


class OutputDirectory:
    """`out` as this rank sees it: the leader describes it, every rank claims it (the leader records the
    identity, `identity`, which the corpus is checked against at the end)."""

    def __init__(self, out: Path, layout: Layout, coord: Coordinator):
        self.out, self.layout, self.coord = out, layout, coord
        self.identity: dict | None = None  # the identity the leader recorded, with the corpus as it was then
        self.kept: tuple[list[str], np.ndarray] = ([], np.zeros(0, dtype=bool))  # the shards kept, their records

    def already_complete(self, finished: dict, data: Sequence[str], force: bool) -> Summary | None:
        """The directory holds this run's finished output. Every rank finds the same, and no rank loads the
        model to find nothing to do; the leader checks, as a resume does, that the samples' images are those
        the corpus `data` (the --data entries) names now, then the shards' checksums, and rebuilds a lost index."""
        if not self.layout.leads:
            return None
        for line in resume.check_images(
            self.out, list(finished["shards"]), finished["identity"], data, force, finished=True
        ):
            note(line)
        for line in resume.settle_finished(self.out, finished):
            note(line)
        note(f"already complete: {self.out} holds this run's finished output, nothing to extract")
        counts = finished["result"]
        return Summary(
            records=counts["records"],
            resumed=counts["extracted"],
            skipped=counts["skipped"],
            rejected=counts["rejected"],
            dropped=counts["dropped"],
        )

    def claim(
        self, existing: resume.Existing, meta: RunInfo, corpus_paths: Sequence[Path], opts: ExtractOptions
    ) -> np.ndarray:
        """Checks that the directory's earlier shards come from this same run (once the model is loaded: the
        default layer ids and the compute dtype come from SGLang), and from the images the corpus (--data) names
        now, as far as `opts` (--force, --allow-other-sglang) let them differ, and returns which records they hold.

        Until here the run has only locked --out (and made it), and a stop ends it at once, SGLang's import and
        load included; the claim writes the manifest, and from it on a stop drops and keeps what it must."""
        interrupts.clean_up_from_here()
        out = self.out

        def claim() -> list[str]:
            self.identity = identity = manifest.run_identity(meta, corpus_paths)
            notes = resume.check_identity(out, identity, opts.force, opts.allow_other_sglang)
            resume.done_mask(out, existing.shards)  # a damaged shard refuses the run before anything is written
            notes += resume.check_images(out, existing.shards, identity, opts.data, opts.force)
            return notes + resume.claim(out, identity)

        notes = self.coord.from_leader(claim)
        done = resume.done_mask(out, existing.shards)
        self.kept = (existing.shards, done)
        if self.layout.leads:
            for line in notes:
                note(line)
            if existing.shards:
                kept = f"{plural(int(done.sum()), 'sample')} in {plural(len(existing.shards), 'complete shard')}"
                note(f"resuming in {out}: {kept} are kept")
        return done

    def finish(
        self,
        summary: Summary,
        written: list,
        sources: Sequence[Source],
        timeline: Timeline,
        take_timings: Callable[[], dict],
    ) -> Summary | None:
        """Every replica has finished writing: the leader describes the whole directory (rejects.jsonl, the
        index of the shards `written`, then the manifest with the run's timings, taken once the rest is written)
        and gets the run's summary."""
        parts = self.coord.all_gather(asdict(summary) if self.layout.writes else None)
        # Replicas end apart (a slower host, a long sample last): waiting for the last is a part of the tail.
        timeline.mark("replicas finished")
        total = Summary()
        for p in parts:
            if p is not None:
                total = total.merge(Summary(**p))
        if not self.layout.leads:
            return None
        self._check_corpus_unchanged(total, sources)
        resume.check_kept(self.out, *self.kept, total.records)
        with resumable(self.out, [source.name for source in sources]):
            _merge_rejects(self.out)
            write_index(self.out, written)
            timeline.mark("finished")
            timings = take_timings()
            # Last, so that a manifest saying "complete" means the index and rejects.jsonl are final too.
            counts = {key: getattr(total, key) for key in ("records", *manifest.LEFT_OUT)}
            manifest.consolidate(
                self.out,
                status="complete",
                result={**counts, "extracted": total.extracted + total.resumed},
                timings=timings,
            )
        note(timing_line(timings))
        return total

    @contextmanager
    def refused_where_the_corpus_breaks_off(self) -> Iterator[None]:
        """A corpus file that cannot be read to its end (cut short, damaged) stops a re-run of the same command at
        the same place: the leader records the refusal, so that the directory does not read as an interrupted
        run that a re-run would finish."""
        try:
            yield
        except CorpusReadError as e:
            if self.layout.leads:
                resume.refuse(
                    self.out,
                    "its corpus, which cannot be read to its end",
                    str(e),
                    "Put a whole copy of the corpus file in its place and re-run the same command with --force (the "
                    "corpus recorded is the damaged file): the samples kept are of the records read before the damage",
                )
            raise

    def _check_corpus_unchanged(self, total: Summary, sources: Sequence[Source]) -> None:
        """The corpus files fingerprinted again, as the identity recorded them when the run began: one changed
        while it was read (cut short, appended to, rewritten) gave samples of neither version whole, and the
        run is not marked complete for the corpus it records."""
        identity = self.identity
        assert identity is not None, "the run was claimed before it finishes"
        now, changed = [], []
        for i, (source, then) in enumerate(zip(sources, identity["corpus"])):
            try:
                now.append(then if source.streamed else manifest.file_fingerprint(source.path))
            except OSError as e:  # moved or deleted meanwhile
                now.append(then)
                changed.append(f"corpus file {i + 1} ({then['path']}): {e.strerror or e} now")
        changed += manifest.corpus_differences(identity, {"corpus": now}, pipes=False)
        if changed:
            raise StoppedError(
                "the corpus changed while this run read it:\n  "
                + "\n  ".join(changed)
                + f"\n{self.out} holds the samples of the {plural(total.records, 'record')} read, which are not the "
                f"corpus recorded when the run began, so the run is not marked complete. Put the corpus back as it "
                f"was and re-run the same command to finish it; or, to take the corpus as it is now, re-run with "
                f"--force (samples are matched to records by position: right where records were only appended)"
            )


def _merge_rejects(out: Path) -> None:
    """One rejects.jsonl in record order from the replicas' parts; the parts go."""
    parts = replicas_files(out, resume.REJECTS_PART)
    rows = sorted((row for part in parts for row in read_journal(part)), key=lambda row: row["index"])
    atomic_write(out / REJECTS_FILE, lambda tmp: tmp.write_text("".join(json.dumps(row) + "\n" for row in rows)))
    for part in parts:
        part.unlink()
