"""Full garbage collections held off while a run starts (offline_extract.lifecycle.startup_gc): each walks every object
torch, transformers and SGLang made, none of it garbage; once the model is loaded they are frozen and full
collections run again. Each case in a process of its own: the collector's state is the process's."""

import json
import subprocess
import sys

from extract_runs import ROOT

WATCHED_RUN = """
import atexit, gc, json, runpy, sys
sys.path.insert(0, {bin!r})
from offline_extract.lifecycle import startup_gc
seen = {{"gen2_deferred": 0, "gen1_deferred": 0, "called": 0, "default": gc.get_threshold()}}
# A library's own gc.collect() (SGLang 0.5.23's, before it sizes the KV pool) is counted apart: start_up holds
# off the collections the collector starts itself, and one this package calls would count as those.
calling, collect = [], gc.collect
def called(*args, **kwargs):
    calling.append(not sys._getframe(1).f_globals.get("__name__", "").startswith("offline_extract"))
    try:
        return collect(*args, **kwargs)
    finally:
        calling.pop()
gc.collect = called
def count(phase, info):
    if phase == "stop" and startup_gc._deferred is not None:
        kind = "called" if calling and calling[-1] else f"gen{{info['generation']}}_deferred"
        seen[kind] = seen.get(kind, 0) + 1
gc.callbacks.append(count)
done = startup_gc.start_up_done
def watched():
    seen["deferred_at_load"] = startup_gc._deferred is not None
    done()
    seen["frozen"], seen["threshold"] = gc.get_freeze_count(), gc.get_threshold()
startup_gc.start_up_done = watched
atexit.register(lambda: print("WATCHED " + json.dumps(seen)))  # after the command's own exit freeze
sys.argv = ["bin/extract.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_full_collections_wait_for_the_start_up_to_be_done_or_to_end():
    code = """
import gc, json
from offline_extract.lifecycle import startup_gc
default = gc.get_threshold()
startup_gc.start_up_done()  # outside a start-up: a library's caller keeps its collector as it set it
untouched = (gc.get_freeze_count(), gc.get_threshold())
with startup_gc.start_up():
    with startup_gc.start_up():  # within another: that one restores
        pass
    deferred = gc.get_threshold()
    kept = [[i] for i in range(1000)]
    startup_gc.start_up_done()
    done = (gc.get_freeze_count(), gc.get_threshold())
gc.unfreeze()
try:
    with startup_gc.start_up():
        raise KeyboardInterrupt  # a command that ends before its model is loaded
except KeyboardInterrupt:
    pass
print(json.dumps([default, untouched, deferred, done, gc.get_freeze_count(), gc.get_threshold()]))
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    default, untouched, deferred, done, frozen_after_end, after_end = json.loads(proc.stdout)
    assert untouched == [0, default]
    assert deferred[:2] == default[:2] and deferred[2] > 10**8
    assert done[0] >= 1000 and done[1] == default
    assert frozen_after_end == 0 and after_end == default  # given back, nothing frozen


def test_a_command_ended_in_process_before_its_load_gives_the_collector_back(tmp_path, monkeypatch):
    # As the tests run the commands (and as a user's script may): the process goes on after them.
    import gc

    from click.testing import CliRunner

    from offline_extract import extraction
    from offline_extract.commands import extract

    before = gc.get_threshold()
    seen = []

    def stopped(opts):
        seen.append(gc.get_threshold())
        raise KeyboardInterrupt

    monkeypatch.setattr(extraction, "run", stopped)
    result = CliRunner().invoke(
        extract.main, ["--data", str(ROOT / "examples" / "corpus.jsonl"), "--out", str(tmp_path)]
    )
    assert result.exit_code == 130
    assert seen[0][2] > 10**8 and gc.get_threshold() == before


def test_bin_extract_makes_no_full_collection_before_its_model_is_loaded(tmp_path):
    # On the embedded model the start-up made 11 of them, 2.2 s of its 12 s on a 2-core VM.
    code = WATCHED_RUN.format(bin=str(ROOT / "bin"), script=str(ROOT / "bin" / "extract.py"))
    proc = _python(code, "--data", "examples/corpus.jsonl", "--out", str(tmp_path / "out"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.split("WATCHED ", 1)[1])
    assert seen["deferred_at_load"] and seen["gen1_deferred"] > 0 and seen["gen2_deferred"] == 0
    assert seen["frozen"] > 100_000  # the libraries' objects, never walked again
    assert seen["threshold"] == seen["default"]
