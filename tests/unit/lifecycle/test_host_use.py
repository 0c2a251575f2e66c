"""The host's threads on its cores while the forwards ran (offline_extract.lifecycle.host_use): each thread's
seconds on a core and queued for one, by pool, and the garbage collector's pauses."""

import gc
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from offline_extract.lifecycle import host_use
from offline_extract.lifecycle.host_use import FORWARDS, HostUse, host_use_line


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_each_thread_is_counted_under_its_pool_and_the_forwards_thread_under_its_own_name():
    use = HostUse()
    # Read while the pool's threads live, as the writer's do when the forwards end.
    with ThreadPoolExecutor(2, thread_name_prefix="busy-helper") as pool:
        list(pool.map(_spin, [0.2, 0.2]))
        _spin(0.15)
        time.sleep(0.2)
        report = use.report()
    threads = report["threads"]
    assert threads["busy-helper"]["threads"] == 2 and threads["busy-helper"]["cpu_s"] >= 0.35
    own = threads[FORWARDS]
    assert own["threads"] == 1 and 0.15 <= own["cpu_s"] < 0.3
    # The sleep is neither on a core nor queued for one: the line says so.
    assert report["host_s"] >= 0.55
    asleep = report["host_s"] - own["cpu_s"] - own["queued_s"]
    assert asleep >= 0.2
    line = host_use_line(report)
    assert line.startswith(f"the forwards' thread in {report['host_s']:.2f} s: {own['cpu_s']:.2f} s on a core, ")
    assert f", {asleep:.2f} s asleep (the GIL, the GPU, the next batch)" in line
    assert f"\nbeside it on a core: busy-helper {threads['busy-helper']['cpu_s']:.2f} s" in line


def test_the_collectors_pauses_are_counted_until_the_report_and_not_after():
    use = HostUse()
    garbage = [[] for _ in range(100_000)]
    for item in garbage:
        item.append(item)  # cycles: only the collector frees them
    del garbage, item
    gc.collect()
    report = use.report()
    assert report["gc_collections"] >= 1 and 0 < report["gc_longest_s"] <= report["gc_s"]
    assert use._on_gc not in gc.callbacks
    gc.collect()
    assert use.collections == report["gc_collections"]
    assert f"garbage collection {report['gc_s']:.2f} s in {report['gc_collections']} " in host_use_line(report)


def test_threads_that_did_nothing_are_left_out():
    with ThreadPoolExecutor(1, thread_name_prefix="idle-helper") as pool:
        pool.submit(lambda: None).result()
        use = HostUse()
        time.sleep(0.05)
        report = use.report()
    assert "idle-helper" not in report["threads"] and FORWARDS in report["threads"]


def test_without_the_kernels_counts_only_the_collector_is_reported(monkeypatch):
    from offline_extract.lifecycle import host_use

    monkeypatch.setattr(host_use, "_TASKS", "/nonexistent/task")
    report = HostUse().report()
    assert report["threads"] == {} and report["gc_collections"] >= 0
    assert host_use_line(report).startswith("garbage collection ")


def test_a_thread_that_ends_inside_the_span_keeps_its_seconds_where_it_says_so():
    def said():
        _spin(0.1)
        host_use.ending()

    use = HostUse()
    for target, name in ((said, "said-it"), (lambda: _spin(0.1), "said-nothing")):
        thread = threading.Thread(target=target, name=name)
        thread.start()
        thread.join()
    threads = use.report()["threads"]
    assert threads["said-it"]["threads"] == 1 and threads["said-it"]["cpu_s"] >= 0.09
    assert "said-nothing" not in threads
    # Only for the spans it ended in.
    assert "said-it" not in HostUse().report()["threads"]


def test_the_processes_it_started_are_counted_by_the_module_they_run(tmp_path):
    (tmp_path / "spinner.py").write_text(
        "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
        "print('spun', flush=True)\ntime.sleep(60)\n"
    )
    use = HostUse()
    child = subprocess.Popen([sys.executable, "-m", "spinner"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "spun\n"
        row = use.report()["threads"]["process spinner"]
    finally:
        child.kill()
        child.wait()
    assert row["processes"] == 1 and row["cpu_s"] >= 0.3


def test_a_thread_that_ended_before_the_span_is_not_mistaken_for_a_later_one_with_its_id():
    # Linux hands an ended thread's id to a later one: the later one's seconds are its own span's.
    go = threading.Event()

    def later():
        go.wait()
        _spin(0.05)
        host_use.ending()

    thread = threading.Thread(target=later, name="inside-the-span")
    thread.start()
    with host_use._ended_lock:  # what an earlier thread of the same id left, before the span
        host_use._ended[thread.native_id] = (next(host_use._order), "before-the-span", (0.0, 0.0))
    use = HostUse()
    go.set()
    thread.join()
    threads = use.report()["threads"]
    assert "before-the-span" not in threads and threads["inside-the-span"]["threads"] == 1
