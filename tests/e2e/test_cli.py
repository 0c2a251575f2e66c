"""What every command shares: -h, --version, and exit status 130 on Ctrl-C; how they are installed."""

import configparser
import importlib
import json
import os
import signal
import subprocess
import sys
import time

import click
import pytest
from click.testing import CliRunner
from extract_runs import ROOT, extract_command

from offline_extract import __version__
from offline_extract.cli import command
from offline_extract.default_model import TINY_VERSION
from offline_extract.extraction import Terminated
from offline_extract.store import resume


@pytest.mark.parametrize("script", ["extract", "export", "inspect", "bench"])
def test_every_script_answers_h_and_version(script):
    path = str(ROOT / "bin" / f"{script}.py")
    version = subprocess.run([sys.executable, path, "--version"], capture_output=True, text=True, cwd=ROOT)
    assert version.returncode == 0 and f"offline_extract {__version__}" in version.stdout, version.stderr[-2000:]
    short = subprocess.run([sys.executable, path, "-h"], capture_output=True, text=True, cwd=ROOT)
    assert short.returncode == 0 and short.stdout.startswith(f"Usage: {script}.py") and "--version" in short.stdout


def test_each_console_script_is_the_command_its_bin_script_runs():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    scripts = dict(line.split(" = ") for line in setup["options.entry_points"]["console_scripts"].strip().splitlines())
    assert set(scripts) == {"offline-extract", "offline-extract-inspect", "offline-extract-export"}
    for name, target in scripts.items():
        module, attr = target.split(":")
        assert isinstance(getattr(importlib.import_module(module), attr), click.Command), name
        script = module.rsplit(".", 1)[1]
        assert f"from {module} import {attr}\n" in (ROOT / "bin" / f"{script}.py").read_text(), name


def _imports(script: str, *args: str) -> tuple[set[str], subprocess.CompletedProcess]:
    """The top-level packages bin/SCRIPT.py imports for these arguments (python -X importtime's list)."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "bin" / f"{script}.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    imported = {
        line.split("|")[-1].strip().split(".")[0] for line in run.stderr.splitlines() if line.startswith("import time:")
    }
    assert imported, run.stderr[-2000:]
    return imported, run


# What takes seconds to import, which --help, --version and a mistyped option need not wait for.
HEAVY = {"torch", "transformers", "sglang", "numpy", "safetensors", "datasets"}


@pytest.mark.parametrize("script", ["extract", "export", "inspect", "bench"])
@pytest.mark.parametrize("args", [["--help"], ["--version"]])
def test_help_and_version_answer_without_importing_torch(script, args):
    # inspect, export and bench took 2-3 s (10 s on a loaded machine), extract 0.1 s.
    imported, run = _imports(script, *args)
    assert run.returncode == 0 and not imported & HEAVY, sorted(imported & HEAVY)


def test_extract_refuses_a_mistyped_option_without_importing_torch():
    imported, run = _imports("extract", "--data", "x.jsonl", "--store", "fp16")
    assert not imported & HEAVY, sorted(imported & HEAVY)
    assert run.returncode == 2 and "'fp16' is not one of 'bf16', 'fp8'" in run.stderr


def test_ctrl_c_exits_130(signals_kept):
    @command()
    def stopped():
        raise KeyboardInterrupt

    result = CliRunner().invoke(stopped, [])
    # One line that reads as the stop it is: it said "Error: interrupted".
    assert (result.exit_code, result.output) == (130, "stopped (Ctrl-C)\n")


def test_ctrl_c_stops_an_export_with_130_and_says_how_to_resume(tmp_path, monkeypatch, signals_kept):
    # It said only "interrupted", though a rerun resumes an export as it does an extraction.
    from offline_extract.commands import export
    from offline_extract.training import export as writing

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writing, "export", interrupted)  # the command imports it when it runs
    dest = tmp_path / "dest"
    dest.mkdir()  # the export had begun writing there
    result = CliRunner().invoke(export.main, [str(tmp_path / "out"), "--to", str(dest)])
    assert result.exit_code == 130
    assert result.output == f"stopped (Ctrl-C); rerunning the same export resumes into {dest}\n"
    # Stopped before its destination was made, it has nothing to resume, and said it had.
    result = CliRunner().invoke(export.main, [str(tmp_path / "out"), "--to", str(tmp_path / "never")])
    assert result.exit_code == 130
    assert f"stopped (Ctrl-C) before anything was written to {tmp_path / 'never'}\n" == result.output


@pytest.mark.parametrize(
    "stop, status, said",
    [
        (KeyboardInterrupt, 130, "stopped (Ctrl-C); "),
        # Not under torchrun, it blamed "another rank" of a run that had none.
        (Terminated, 143, "dry run: stopped by SIGTERM; "),
    ],
)
def test_a_stopped_dry_run_says_it_wrote_nothing(stop, status, said, tmp_path, monkeypatch, signals_kept):
    # It said "re-running the same command resumes into OUT", as the real run does, though it writes nothing there;
    # then "OUT is as it was" of an OUT that was never there.
    from offline_extract import extraction
    from offline_extract.commands import extract

    def stopped(opts):
        raise stop

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(extraction, "dry_run", stopped)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        extract.main, ["--data", str(ROOT / "examples" / "corpus.jsonl"), "--out", str(out), "--dry-run"]
    )
    assert (result.exit_code, result.output) == (status, f"{said}a dry run writes nothing\n")
    assert not out.exists()
    out.mkdir()
    result = CliRunner().invoke(
        extract.main, ["--data", str(ROOT / "examples" / "corpus.jsonl"), "--out", str(out), "--dry-run"]
    )
    assert (result.exit_code, result.output) == (status, f"{said}a dry run writes nothing, so {out} is as it was\n")


def test_a_refusal_is_broken_to_the_terminals_width_and_left_whole_in_a_log(terminal, tmp_path):
    # Some ran to 600 characters, which the terminal broke mid-word.
    missing = tmp_path / "an-output-directory-whose-name-alone-is-long-enough-to-need-a-line-of-its-own" / "out"
    command = [sys.executable, str(ROOT / "bin" / "inspect.py"), str(missing)]
    logged = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    (line,) = logged.stderr.splitlines()
    assert logged.returncode == 1 and line.startswith(f"Error: {missing} does not exist: ") and len(line) > 120
    fd, shown = terminal(60)
    proc = subprocess.run(command, stderr=fd, cwd=ROOT, timeout=120)
    os.close(fd)
    rows = shown()
    assert proc.returncode == 1 and rows[0].rstrip() == "Error:" and rows[1] == f"  {missing}", rows
    assert all(len(row) <= 60 for row in rows[2:]) and " ".join(row.strip() for row in rows) == line, rows


@pytest.mark.parametrize(
    "first",
    [
        "import offline_extract.commands",
        "sys.path.insert(0, 'bin'); import _bin_path, offline_extract.commands.extract",
    ],
)
def test_ctrl_c_while_a_command_still_imports_exits_130_without_a_traceback(first):
    # What an installed command and a bin/ script do first, then Ctrl-C while the heavy imports would run.
    code = f"import sys; {first}; import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(30)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert (proc.returncode, proc.stderr) == (130, "stopped (Ctrl-C)\n")


def test_ctrl_c_stops_an_extraction_with_130_says_what_it_left_and_a_rerun_finishes(tmp_path, tiny_model_dir):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"tiny-llama-v{TINY_VERSION}").symlink_to(tiny_model_dir)
    out = tmp_path / "out"
    command = extract_command(out, "--data", ROOT / "examples" / "corpus.jsonl")
    env = {**os.environ, "OFFLINE_EXTRACT_CACHE": str(cache)}
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while not (out / resume.LOCK_NAME).exists():  # the run holds its directory: it is past the option checks
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)  # SGLang is importing or loading the model: nothing is written yet
    asked = time.monotonic()
    proc.wait(timeout=300)
    # It waited for SGLang's import to return, seconds (the README promises a stop "at any moment").
    waited = time.monotonic() - asked
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert waited < 2, f"{waited:.1f} s from Ctrl-C to the end"
    # It promised that a rerun "resumes into" the directory, and left it empty.
    assert stderr.splitlines()[-1] == f"stopped (Ctrl-C) before anything was written to {out}", stderr[-3000:]
    assert not out.exists(), "the directory it made and wrote nothing to is left"
    rerun = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("rank", [None, "3"])
def test_sigterm_is_put_down_to_torchrun_only_under_torchrun(rank, tmp_path, monkeypatch, signals_kept):
    from offline_extract import extraction
    from offline_extract.commands import extract

    def stopped(opts):
        raise Terminated

    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(extraction, "run", stopped)
    out = tmp_path / "out"
    result = CliRunner().invoke(extract.main, ["--data", str(ROOT / "examples" / "corpus.jsonl"), "--out", str(out)])
    assert result.exit_code == 143
    assert result.output == (
        f"extraction: stopped by SIGTERM before anything was written to {out}\n"
        if rank is None
        else f"rank 3: stopped by SIGTERM (torchrun sends it to every rank once one fails, and its report names that "
        f"one) before anything was written to {out}\n"
    )


@pytest.mark.parametrize("pipe", [False, True], ids=["a file", "a pipe"])
def test_a_stopped_extraction_names_the_complete_shards_it_keeps(pipe, tmp_path, monkeypatch, signals_kept):
    from offline_extract import extraction
    from offline_extract.commands import extract

    out = tmp_path / "out"
    corpus = ROOT / "examples" / "corpus.jsonl"
    if pipe:  # as <(zcat corpus.jsonl.gz) gives it; never opened here
        corpus = tmp_path / "fifo"
        os.mkfifo(corpus)

    def stopped(opts):
        out.mkdir()
        (out / "shard_000.safetensors").write_bytes(b"")  # complete shards under their final names
        (out / "shard_001.safetensors").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(extraction, "run", stopped)
    result = CliRunner().invoke(extract.main, ["--data", str(corpus), "--out", str(out)])
    # A pipe's records cannot be compared with the kept shards': the same command alone is refused.
    how = (
        f"re-running the same command with --force resumes from them: --data {corpus} is a pipe, whose records cannot "
        f"be compared with theirs (right where it gives the same records in the same order)"
        if pipe
        else "re-running the same command resumes from them"
    )
    assert (result.exit_code, result.output) == (
        130,
        f"stopped (Ctrl-C); the 2 complete shards in {out} are kept, and {how}\n",
    )


# A command's process stopped with a thread still at work, as an extraction's stop can leave the tokenizer loading
# beside the model or the parity reference's weights still being read (here a thread that the interpreter's
# teardown would wait for), and a handler that the teardown would run.
_STOPPED_WITH_A_THREAD_AT_WORK = """
import atexit, os, sys, threading
sys.path.insert(0, "bin")
import _bin_path
from offline_extract import extraction
from offline_extract.commands.extract import main

def stopped(opts):
    threading.Thread(target=threading.Event().wait, name="at work").start()
    raise {stop}

atexit.register(lambda: os.write(2, b"teardown ran\\n"))
extraction.run = stopped
sys.argv = ["extract.py", "--data", {corpus!r}, "--out", {out!r}]
main()  # as bin/extract.py and the console script run it
"""


@pytest.mark.parametrize(
    "stop, status, said",
    [
        ("KeyboardInterrupt", 130, "stopped (Ctrl-C)"),
        ("extraction.Terminated", 143, "extraction: stopped by SIGTERM"),
    ],
)
def test_a_stopped_command_exits_with_its_status_without_the_interpreters_teardown(stop, status, said, tmp_path):
    """Once the command's own cleanup has run and its words are out, a stop ends the process (cli._Command):
    the teardown raced threads still in C code, the likeliest reason why an extraction interrupted on a loaded
    machine once died of SIGSEGV instead of exiting 130. Here the teardown would wait for the thread for ever."""
    out = tmp_path / "out"
    code = _STOPPED_WITH_A_THREAD_AT_WORK.format(
        stop=stop, corpus=str(ROOT / "examples" / "corpus.jsonl"), out=str(out)
    )
    env = {key: value for key, value in os.environ.items() if key != "RANK"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"still running 60 s after the stop: {stderr[-2000:]}")
    assert (proc.returncode, stdout, stderr) == (status, "", f"{said} before anything was written to {out}\n")


def test_a_command_leaves_the_interpreters_teardown_no_objects_to_collect():
    """Every command freezes what the process made before the interpreter tears it down: the teardown's
    collections over torch's, transformers' and SGLang's objects took 2.5-3 s after each run (docs/start-up.md).
    The handler registered before the command's runs after it, and sees the objects frozen."""
    code = (
        "import atexit, gc, os; atexit.register(lambda: os.write(1, str(gc.get_freeze_count()).encode())); "
        "import offline_extract.commands; cycle = [[]]; cycle[0].append(cycle)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 1000, "nothing was frozen at exit"
