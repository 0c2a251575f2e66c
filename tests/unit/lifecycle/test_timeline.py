"""A run's clock (offline_extract.lifecycle.timeline) starts with the interpreter that runs our program, whichever
process it was exec'd in."""

import subprocess
import sys
import time

from extract_runs import ROOT

# What a command's first line does (bin/ and the console scripts import the package first), then the clock's
# origin as wall-clock time, the clock's reading and the process's id.
CLOCK = (
    "import offline_extract.commands, os, time; from offline_extract.lifecycle.timeline import Timeline; "
    "{before}now = Timeline().now(); print(time.time() - now, now, os.getpid())"
)


def _clock(command: list[str]) -> tuple[float, float, int]:
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    origin, now, pid = out.split()
    return float(origin), float(now), int(pid) == proc.pid


def test_the_clock_starts_with_the_interpreter_not_with_the_shell_it_was_execed_from():
    """`bash -c 'sleep 3 && python ...'` runs python in bash's own process (the last command is exec'd), whose
    kernel start time is bash's: counted from there, the sleep (in a one-line install-and-run, pip's
    minutes) was ours."""
    launched = time.time()
    origin, _, execed = _clock(["bash", "-c", f"sleep 3 && {sys.executable} -c '{CLOCK.format(before='')}'"])
    assert execed, "bash forked for its last command: this test would not show which start the clock took"
    assert origin > launched + 2, f"the clock counts {launched + 3 - origin:.1f} s of the shell's sleep"


def test_the_clock_counts_our_own_waits():
    _, now, _ = _clock([sys.executable, "-c", CLOCK.format(before="time.sleep(0.5); ")])
    assert 0.5 <= now < 30
