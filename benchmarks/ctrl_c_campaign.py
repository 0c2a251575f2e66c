#!/usr/bin/env python
"""Ctrl-C at random moments of an extraction's start-up, many times, and what each left.

Each run is the README's main job (`bin/extract.py` on the embedded tiny model, --verify 4) into a fresh
directory, sent SIGINT `--earliest` to `--latest` seconds after launch (uniformly at random, seeded):
while Python, numpy, torch, SGLang and transformers import, while the model loads, during the parity
gate or the extraction. With `--after-take-over` the seconds are counted from the moment the run holds
its directory (its lock file is there), where a loaded machine takes longer than `--latest` to get to:
SGLang's import, the model load, the gate, the extraction. `--burners` processes spin meanwhile, for a loaded machine (the load average
is recorded with each run). Each interrupted run that left its directory is then run again, as the
stop's line says, and must finish: exit status 0, a complete manifest, every sample of the corpus (a
run that left nothing would only start afresh).

What a stop must give, and each run is checked for: exit status 130, one line of its own after the run's
own notes (nothing of Python's: no traceback, no C++ terminate), and a rerun that finishes.

\b
    python -m benchmarks.ctrl_c_campaign --runs 60 --json benchmarks/results/ctrl_c_campaign_DATE.json
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import click

from benchmarks import command_line, emit, program

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "examples" / "corpus.jsonl"
FOREIGN = ("Traceback", "terminate called", "Segmentation fault", "core dumped", "Error")


def _burn(stop) -> None:
    while not stop.is_set():
        pass


def _command(out: Path) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "bin" / "extract.py"),
        "--data",
        str(CORPUS),
        "--out",
        str(out),
        "--verify",
        "4",
        "--no-progress",
    ]


def _what_is_in(out: Path) -> str:
    if not out.exists():
        return "nothing (no directory)"
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.startswith("shard_")]
    if shards:
        return f"{len(shards)} shards"
    return "manifest only" if "manifest.json" in names else f"other: {names}"


def one_run(out: Path, delay: float, after_take_over: bool) -> dict:
    load = os.getloadavg()[0]
    started = time.monotonic()
    proc = subprocess.Popen(_command(out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while after_take_over and not (out / ".lock").exists() and proc.poll() is None:
        time.sleep(0.02)
    taken_over = time.monotonic() - started
    sent = False
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGINT)
        sent = True
    delay += taken_over if after_take_over else 0.0
    try:
        stdout, stderr = proc.communicate(timeout=300)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        returncode = "hung (killed at 300 s)"
    ended = time.monotonic() - started
    lines = [line for line in stderr.splitlines() if line.strip()]
    row = {
        "delay_s": round(delay, 2),
        "taken_over_s": round(taken_over, 2) if after_take_over else None,
        "load_average": round(load, 1),
        "sent": sent,
        "returncode": returncode,
        "exit_s": round(ended - delay, 2) if sent else None,
        "last_line": (lines[-1] if lines else "").replace(str(out), "OUT"),
        "stop_lines": sum(line.startswith("stopped (Ctrl-C)") for line in lines),
        "foreign": [word for word in FOREIGN if word in stderr],
        "stdout": stdout[-500:],
        "left": _what_is_in(out),
    }
    if row["foreign"] or (sent and returncode != 130):
        row["stderr_tail"] = stderr[-3000:]
    if sent and out.exists():
        rerun = subprocess.run(_command(out), cwd=ROOT, capture_output=True, text=True, timeout=900)
        manifest = out / "manifest.json"
        status = json.loads(manifest.read_text()).get("status") if manifest.exists() else None
        extracted = json.loads(manifest.read_text()).get("result", {}).get("extracted") if manifest.exists() else None
        row["rerun"] = {"returncode": rerun.returncode, "status": status, "extracted": extracted}
        if rerun.returncode:
            row["rerun"]["stderr_tail"] = rerun.stderr[-3000:]
    return row


def good(row: dict, samples: int) -> bool:
    if not row["sent"]:
        return row["returncode"] == 0
    rerun = row.get("rerun")
    resumed = rerun is None or (
        rerun["returncode"] == 0 and rerun["status"] == "complete" and rerun["extracted"] == samples
    )
    return (
        row["returncode"] == 130
        and row["stop_lines"] == 1
        and row["last_line"].startswith("stopped (Ctrl-C)")
        and not row["foreign"]
        and resumed
    )


@program(__doc__)
@click.option("--runs", default=40, show_default=True)
@click.option("--earliest", default=0.5, show_default=True, help="Seconds after launch, at the soonest.")
@click.option("--latest", default=15.0, show_default=True, help="Seconds after launch, at the latest.")
@click.option("--after-take-over", is_flag=True, help="Count the seconds from the moment the run holds --out.")
@click.option("--burners", default=0, show_default=True, help="Processes that spin meanwhile, for a loaded machine.")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", default=None, help="Also save the result to this file.")
def main(
    runs: int, earliest: float, latest: float, after_take_over: bool, burners: int, seed: int, json_path: str | None
) -> None:
    rng = random.Random(seed)
    samples = sum(1 for line in CORPUS.read_text().splitlines() if line.strip())
    stop = multiprocessing.Event()
    spinning = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True) for _ in range(burners)]
    for p in spinning:
        p.start()
    rows = []
    work = Path(tempfile.mkdtemp(prefix="ctrl-c-campaign-"))
    try:
        for k in range(runs):
            out = work / f"out{k}"
            row = one_run(out, rng.uniform(earliest, latest), after_take_over)
            row["good"] = good(row, samples)
            rows.append(row)
            print(
                json.dumps(
                    {"run": k, **{key: row[key] for key in ("delay_s", "sent", "returncode", "last_line", "good")}}
                ),
                file=sys.stderr,
                flush=True,
            )
            shutil.rmtree(out, ignore_errors=True)
            if json_path:  # so far, in case the campaign is cut short
                Path(json_path).write_text(json.dumps(summary(rows, runs), indent=2) + "\n")
    finally:
        stop.set()
        for p in spinning:
            p.join()
        shutil.rmtree(work, ignore_errors=True)
    emit(summary(rows, runs), json_path)


def summary(rows: list[dict], runs: int) -> dict:
    sent = [row for row in rows if row["sent"]]
    return {
        "command": command_line("python -m benchmarks.ctrl_c_campaign"),
        "extraction": " ".join(_command(Path("OUT"))[1:]),
        "cpus": os.cpu_count(),
        "runs": len(rows),
        "runs_asked": runs,
        "interrupted": len(sent),
        "finished_before_the_signal": len(rows) - len(sent),
        "good": sum(row["good"] for row in rows),
        "bad": [row for row in rows if not row["good"]],
        "returncodes": dict(Counter(str(row["returncode"]) for row in sent)),
        "left": dict(Counter(row["left"] for row in sent)),
        "last_lines": dict(Counter(row["last_line"] for row in sent)),
        "rerun_returncodes": dict(Counter(str(row["rerun"]["returncode"]) for row in sent if "rerun" in row)),
        "load_average_range": [min(row["load_average"] for row in rows), max(row["load_average"] for row in rows)],
        "exit_s_max": max((row["exit_s"] for row in sent if row.get("exit_s") is not None), default=None),
        "rows": rows,
    }


if __name__ == "__main__":
    main()
