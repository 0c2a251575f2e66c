"""Ctrl-C through `lifecycle.interrupts`: never inside an import, never lost, an error after it taken as the stop."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from extract_runs import ROOT

from offline_extract.lifecycle import interrupts

# A module whose import takes a Ctrl-C half-way: torch's, numpy's or SGLang's as a user's Ctrl-C reaches it.
_SLOW_MODULE = """
import os, signal, time
os.kill(os.getpid(), signal.SIGINT)
started = time.monotonic()
while time.monotonic() - started < 0.3:  # more of the import, in Python, where the handler runs
    pass
whole = True
"""


@pytest.fixture
def guarded(signals_kept):
    with interrupts.guard(exits_at_once=False):
        interrupts.clean_up_from_here()
        yield


def test_ctrl_c_during_an_import_lands_once_the_import_returns(guarded, tmp_path, monkeypatch):
    # It landed inside the import (Python's own handler), which left the module half-made: numpy's, torch's or
    # SGLang's next import then failed with a traceback of its own.
    (tmp_path / "slow_module.py").write_text(_SLOW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        import slow_module  # noqa: F401

        started = time.monotonic()
        while time.monotonic() - started < 30:  # what follows the import, where the interrupt lands
            pass
        pytest.fail("the Ctrl-C never landed")
    assert sys.modules["slow_module"].whole


def test_a_ctrl_c_that_a_library_swallowed_is_taken_at_the_next_safe_point(guarded):
    from offline_extract.lifecycle.timeline import Timeline

    timeline = Timeline()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except BaseException:  # a library's bare except
        pass
    with pytest.raises(KeyboardInterrupt):
        timeline.mark("next phase")


def test_an_error_after_ctrl_c_and_a_return_all_the_same_end_as_the_stop(guarded):
    with pytest.raises(ValueError):  # before Ctrl-C, an error is what it is
        with interrupts.as_stop():
            raise ValueError("bad input")
    with pytest.raises(KeyboardInterrupt):
        with interrupts.as_stop():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                raise ImportError("partially initialized module 'numpy'") from None  # what a library made of it
    with pytest.raises(KeyboardInterrupt):
        with interrupts.as_stop():
            pass  # it ran on, the Ctrl-C swallowed on the way


def test_a_threads_interrupt_is_no_stop_and_once_withdrawn_never_lands(guarded):
    with pytest.raises(KeyboardInterrupt):
        threading.Thread(target=interrupts.interrupt_main).start()
        time.sleep(5)
    assert not interrupts.requested()  # a thread's failure, not the user's Ctrl-C
    interrupts.withdraw()  # nothing pending: withdrawing is harmless
    thread = threading.Thread(target=lambda: (interrupts.interrupt_main(), interrupts.withdraw()))
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # the alarm arrives after the withdrawal
    try:
        thread.start()
        thread.join()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGALRM])
    for _ in range(20):
        time.sleep(0.01)


def test_the_guard_puts_back_the_handlers_it_found(signals_kept):
    found = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM)
    with interrupts.guard(exits_at_once=False):
        assert interrupts.guarded()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM)) == found
    assert not interrupts.guarded()


def test_ctrl_c_before_anything_is_written_ends_the_program_at_once_with_its_words():
    # As the program, before an extraction takes its --out over: nothing to clean up, so nothing is raised into
    # whatever C code runs at that moment.
    code = textwrap.dedent("""
        import os, signal, time
        from offline_extract.lifecycle import interrupts
        with interrupts.guard(exits_at_once=True):
            interrupts.at_once("stopped (Ctrl-C) before anything was written to out")
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        130,
        "",
        "stopped (Ctrl-C) before anything was written to out\n",
    )


def test_a_stop_at_once_inside_an_import_undoes_its_steps_and_tells_the_terminal(tmp_path):
    # SGLang's import and model load ran after the run took its --out over, so Ctrl-C waited seconds for the import
    # to return; ending at once there must release the lock and remove the empty --out first, and say so on the
    # terminal while the load has fd 2 diverted to hide its libraries' output.
    (tmp_path / "slow_module.py").write_text(_SLOW_MODULE)
    made = tmp_path / "out"
    code = textwrap.dedent(f"""
        import os, sys, time
        from offline_extract.lifecycle import interrupts
        sys.path.insert(0, {str(tmp_path)!r})
        os.mkdir({str(made)!r})
        lock = open({str(made / ".lock")!r}, "w")
        with interrupts.guard(exits_at_once=True):
            interrupts.at_once("stopped (Ctrl-C) before anything was written to out")
            interrupts.undo_at_once(lambda: os.rmdir({str(made)!r}))
            interrupts.undo_at_once(lambda: os.unlink(lock.name))
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            with interrupts.held_back():
                import slow_module
                print("held back to the end", flush=True)
            time.sleep(30)
            print("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        130,
        "held back to the end\n",
        "stopped (Ctrl-C) before anything was written to out\n",
    )
    assert not made.exists()


def test_ctrl_c_inside_a_held_back_step_lands_once_it_is_done(guarded):
    # A stop inside the output lock's creation left OUT/.lock behind (the lock not yet the run's to release), and
    # one while the terminal was being given back sent the stop's line into the hidden output.
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.held_back():
            os.kill(os.getpid(), signal.SIGINT)
            started = time.monotonic()
            while time.monotonic() - started < 0.3:  # more of the step, in Python, where the handler runs
                pass
            done.append("whole")
        time.sleep(5)
    assert done == ["whole"]
