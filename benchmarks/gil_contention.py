#!/usr/bin/env python
"""How much the image pool slows the thread that runs the forwards through the GIL, without a GPU: the main
thread runs a loop standing in for kernel launches (small torch operations on small CPU tensors, each of a few
microseconds, each releasing the GIL and taking it back as a launch does), timed alone, then while a thread
prepares image chats as the feed's thread does (SampleTokenizer.many, `--together` records a call, its image
chats on the run's image pool of `--image-threads` threads), at each of `--intervals` (sys.setswitchinterval,
CPython's default 5 ms first), and while the same image chats are prepared in another process, which shares
the cores but not the GIL: what the cores alone cost the loop. Also the image chats' rate (images/s) alone and
beside the loop at each interval: what a shorter interval costs the pool.

\b
    python benchmarks/image_chats.py /tmp/chats.jsonl --chats 64
    python benchmarks/gil_contention.py --data /tmp/chats.jsonl [--image-threads 1,2] [--json OUT.json]

`us_per_op`: the loop's wall time over its operations, while the image chats were prepared; `slowdown`: that
over the loop's alone at the default interval, and `over_beside_process` over its time beside the other
process (the GIL's part); `waits_s`: the loop's time in operations that took more than WAIT_US each (the GIL
or a core given back late), `mean_wait_ms` the mean of those. Repeats run the cases interleaved; the summary gives their medians.
"""

import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's benchmarks and offline_extract

from benchmarks import command_line, emit, program  # noqa: E402
from benchmarks.feed_rate import model_dir  # noqa: E402

# An operation that took longer than this waited for the GIL or a core: alone, each takes a few microseconds.
WAIT_US = 100
OPS_PER_ROUND = 200


def _tokenizer(path: Path, data: str, image_threads: int):
    from offline_extract.data.corpus import Record, read_corpus
    from offline_extract.extraction import sample_tokenizer
    from offline_extract.options import ExtractOptions

    st = sample_tokenizer(ExtractOptions(data=(data,), model=str(path), image_threads=image_threads), path)
    records = [r for r in read_corpus([data]) if isinstance(r, Record) and r.images]
    st.many(records[:4])  # the processor's and torch's first calls
    return st, records


def _feed(st, records, together: int) -> dict:
    """The image chats prepared as the feed's thread prepares them, `together` records a call."""
    start = time.perf_counter()
    for i in range(0, len(records), together):
        st.many(records[i : i + together])
    seconds = time.perf_counter() - start
    images = sum(len(r.images) for r in records)
    return {"seconds": seconds, "images_s": images / seconds}


def _loop(busy) -> dict:
    """The stand-in for kernel launches, in rounds of OPS_PER_ROUND operations while `busy()`."""
    import torch

    a, b, out = torch.ones(16), torch.ones(16), torch.empty(16)
    ops, waits, waited = 0, 0, 0
    clock = time.perf_counter_ns
    start = clock()
    while busy():
        for _ in range(OPS_PER_ROUND // 2):
            t0 = clock()
            torch.add(a, b, out=out)
            t1 = clock()
            out.mul_(0.5)
            t2 = clock()
            for took in (t1 - t0, t2 - t1):
                if took > WAIT_US * 1000:
                    waits, waited = waits + 1, waited + took
        ops += OPS_PER_ROUND
    seconds = (clock() - start) / 1e9
    return {"ops": ops, "us_per_op": seconds / ops * 1e6, "waits": waits, "waits_s": waited / 1e9}


def _beside_thread(st, records, together: int) -> dict:
    """The loop while a thread prepares the image chats."""
    result = {}
    feed = threading.Thread(target=lambda: result.update(_feed(st, records, together)), name="feed")
    feed.start()
    loop = _loop(feed.is_alive)
    feed.join()
    return {**loop, "feed_images_s": result["images_s"]}


def _child(path: Path, data: str, image_threads: int, together: int, ready, go, done, results) -> None:
    import torch

    torch.set_num_threads(1)  # as in the process it stands beside
    st, records = _tokenizer(path, data, image_threads)
    ready.set()
    go.wait()
    results.put(_feed(st, records, together))
    done.set()


def _beside_process(path: Path, data: str, image_threads: int, together: int) -> dict:
    """The loop while another process prepares the image chats: the cores shared, the GIL not."""
    spawn = multiprocessing.get_context("spawn")
    ready, go, done, results = spawn.Event(), spawn.Event(), spawn.Event(), spawn.Queue()
    child = spawn.Process(target=_child, args=(path, data, image_threads, together, ready, go, done, results))
    child.start()
    ready.wait()
    go.set()
    loop = _loop(lambda: not done.is_set())
    feed = results.get()
    child.join()
    return {**loop, "feed_images_s": feed["images_s"]}


def _timed(seconds: float):
    end = time.perf_counter() + seconds
    return lambda: time.perf_counter() < end


def _one_repeat(st, records, path, data, threads, intervals, together, alone_s) -> dict:
    out = {}
    for ms in intervals:
        sys.setswitchinterval(ms / 1e3)
        try:
            out[f"{ms:g}ms"] = {
                "loop_alone": _loop(_timed(alone_s)),
                "pool_alone": _feed(st, records, together),
                "loop_beside_pool": _beside_thread(st, records, together),
            }
        finally:
            sys.setswitchinterval(DEFAULT_INTERVAL)
    out["loop_beside_process"] = _beside_process(path, data, threads, together)
    return out


def _value(run: dict, keys: tuple) -> float:
    for key in keys:
        run = run[key]
    return run


def _median(runs: list[dict], *keys) -> float:
    return statistics.median(_value(run, keys) for run in runs)


def _ratio(runs: list[dict], top: tuple, bottom: tuple) -> float:
    """The median over the repeats of `top` over `bottom` in the same repeat: the host's other load drifts
    between repeats."""
    return statistics.median(_value(run, top) / _value(run, bottom) for run in runs)


def _waits(runs: list[dict], *keys) -> dict:
    """The loop's waits: with each ending where the image chats' thread let the GIL go, their mean is shorter
    than the switch interval; where it was taken from that thread, as long."""
    return {
        "waits_s": _median(runs, *keys, "waits_s"),
        "mean_wait_ms": statistics.median(
            _value(run, keys)["waits_s"] / max(1, _value(run, keys)["waits"]) * 1e3 for run in runs
        ),
    }


def _summary(runs: list[dict], intervals) -> dict:
    alone = (f"{intervals[0]:g}ms", "loop_alone", "us_per_op")
    process = ("loop_beside_process", "us_per_op")
    summary = {
        "loop_alone_us_per_op": _median(runs, *alone),
        "beside_process": {
            "us_per_op": _median(runs, *process),
            "slowdown": _ratio(runs, process, alone),
            **_waits(runs, "loop_beside_process"),
            "feed_images_s": _median(runs, "loop_beside_process", "feed_images_s"),
        },
    }
    for ms in intervals:
        key = f"{ms:g}ms"
        pool = (key, "loop_beside_pool", "us_per_op")
        summary[key] = {
            "loop_alone_us_per_op": _median(runs, key, "loop_alone", "us_per_op"),
            "beside_pool_us_per_op": _median(runs, *pool),
            "slowdown": _ratio(runs, pool, alone),
            # The GIL's part: beside the pool's threads over beside the process, which shares only the cores.
            "over_beside_process": _ratio(runs, pool, process),
            **_waits(runs, key, "loop_beside_pool"),
            "pool_alone_images_s": _median(runs, key, "pool_alone", "images_s"),
            "pool_beside_loop_images_s": _median(runs, key, "loop_beside_pool", "feed_images_s"),
        }
    return summary


DEFAULT_INTERVAL = sys.getswitchinterval()


@program(help=__doc__)
@click.option("--model", default=None, help="A vision-language model directory with its processor.")
@click.option("--shape", default=None, help="Instead of --model: a VISION_LANGUAGE_SHAPES key; default: qwen2_5_vl_7b.")
@click.option("--data", required=True, help="A JSONL corpus of image chats (benchmarks/image_chats.py).")
@click.option("--image-threads", default="2", show_default=True, help="Comma-separated counts to time.")
@click.option(
    "--intervals", default="5,0.5,0.1", show_default=True, help="Switch intervals in ms, the first CPython's."
)
@click.option("--together", default=64, show_default=True, help="Records a call of the tokenizer (a run's: 64).")
@click.option("--alone-seconds", default=2.0, show_default=True, help="How long the loop runs alone.")
@click.option("--repeats", default=3, show_default=True)
@click.option("--json", "json_path", default=None, help="Also write the result here.")
def main(model, shape, data, image_threads, intervals, together, alone_seconds, repeats, json_path):
    import torch

    torch.set_num_threads(1)  # the loop's operations on its own core, as a launch's, and a one-thread feed's
    path = model_dir(model, shape or (None if model else "qwen2_5_vl_7b"))
    intervals = [float(ms) for ms in intervals.split(",")]
    result = {
        "command": command_line("python benchmarks/gil_contention.py"),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "default_switch_interval_ms": DEFAULT_INTERVAL * 1e3,
        "wait_us": WAIT_US,
        # The host's load (1, 5, 15 minutes) before and after: other work on its cores slows every case.
        "load_before": os.getloadavg(),
    }
    for threads in (int(n) for n in image_threads.split(",")):
        st, records = _tokenizer(path, data, threads)
        runs = [
            _one_repeat(st, records, path, data, threads, intervals, together, alone_seconds) for _ in range(repeats)
        ]
        result[f"image_threads_{threads}"] = {
            "records": len(records),
            "images": sum(len(r.images) for r in records),
            "summary": _summary(runs, intervals),
            "runs": runs,
        }
    result["load_after"] = os.getloadavg()
    emit(result, json_path)


if __name__ == "__main__":
    main()
