"""Where the pipeline keeps what it makes, and how a step knows it is done.

Two folders. DATA is small and kept across device calls and machines: carried to the GPU machine (it
is git-ignored, `carry` names it; there the calls merge it into a folder of the machine's own, README.md)
and brought back packed (`pipeline.py pack`): the prompts, the
responses, each drafter's training record and each serving measurement, and the log of every command
run. SCRATCH is large and lives on one machine only (by default on /dev/shm): the corpus, the stores,
the feature files, the SpecForge runs and the drafters, which a fresh machine makes again.

A step is complete when its marker, a JSON file written last and atomically, exists: a complete step is
skipped, and an incomplete one is run again, each of its parts either skipped because it is complete
(a part file renamed into place, a resumed extraction or export, SpecForge's own skip of the files it
has) or made again from the start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from offline_extract.store.atomic import atomic_write

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = ROOT / ".drafter"
DEFAULT_SCRATCH = Path("/dev/shm/drafter")


@dataclass(frozen=True)
class Layout:
    data: Path
    scratch: Path

    # DATA
    @property
    def prompts(self) -> Path:
        return self.data / "prompts"

    @property
    def responses(self) -> Path:
        return self.data / "responses"

    def train_record(self, run: str) -> Path:
        return self.data / "train" / f"{run}.json"

    def serve_record(self, name: str) -> Path:
        return self.data / "serve" / f"{name}.json"

    @property
    def commands(self) -> Path:
        return self.data / "commands.jsonl"

    # SCRATCH
    @property
    def corpus(self) -> Path:
        return self.scratch / "corpus.jsonl"

    def store(self, variant: str) -> Path:
        return self.scratch / "store" / variant

    def features(self, variant: str) -> Path:
        return self.scratch / "features" / variant

    def view(self, variant: str) -> Path:
        return self.scratch / "views" / variant

    @property
    def target_copy(self) -> Path:
        return self.scratch / "target-for-specforge"

    @property
    def draft_config(self) -> Path:
        return self.scratch / "draft_config.json"

    def train_dir(self, run: str) -> Path:
        return self.scratch / "train" / run

    def drafter(self, run: str) -> Path:
        return self.scratch / "drafters" / run

    @property
    def logs(self) -> Path:
        """Every step's own log (the subprocesses' output, SGLang's info lines), packed by `pack`."""
        return self.scratch / "logs"


MARKER = "DONE.json"


def marker(folder: Path) -> Path:
    return folder / MARKER


def is_done(folder: Path) -> bool:
    return marker(folder).is_file()


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2) + "\n"))


def read_json(path: Path):
    return json.loads(path.read_text())


def mark_done(folder: Path, **facts) -> None:
    write_json(marker(folder), facts)


def run_logged(layout: Layout, step: str, argv: list[str], log: Path, env: dict | None = None) -> float:
    """Runs `argv`, its output to `log`, and appends it to DATA's command log; returns its wall seconds.
    Raises naming the log when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, argv))}\n")
        f.flush()
        code = subprocess.call([str(a) for a in argv], stdout=f, stderr=subprocess.STDOUT, env=env)
    wall = time.time() - start
    record_command(layout, step, [str(a) for a in argv], wall, code)
    if code:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{step}: {Path(argv[0]).name} exited {code}; its log is {log}:\n" + "\n".join(tail))
    return wall


def record_command(layout: Layout, step: str, argv: list[str], wall_s: float, rc: int) -> None:
    layout.commands.parent.mkdir(parents=True, exist_ok=True)
    with open(layout.commands, "a") as f:
        f.write(
            json.dumps(
                {
                    "step": step,
                    "argv": argv,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - wall_s)),
                    "wall_s": round(wall_s, 1),
                    "rc": rc,
                    "host": os.uname().nodename,
                }
            )
            + "\n"
        )


def python() -> str:
    return sys.executable
