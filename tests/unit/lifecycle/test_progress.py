"""What a run prints while it works: heartbeat lines without the bar, and the libraries' own output hidden."""

import logging
import os
import re
import sys
import time

import pytest

from offline_extract.lifecycle.progress import RunProgress, foreign_output_hidden

BEAT = re.compile(
    r"^extract: (\d+)/24 samples, ([\d,]+) tokens, [\d,]+ tok/s, (\d+\.\d [KMGT]B) written, \d+:\d\d:\d\d elapsed, "
    r"ETA \d+:\d\d:\d\d$"
)


def test_without_the_bar_a_line_comes_every_interval(capfd):
    with RunProgress(lambda: 24, "extract", heartbeat=0.05) as progress:
        deadline = time.monotonic() + 10
        while progress.total is None and time.monotonic() < deadline:  # the count runs on a thread
            time.sleep(0.01)
        for _ in range(3):
            time.sleep(0.06)
            progress.advance(8, 1000, 2_000_000_000)
        progress.advance(0, 0, 2_000_000_000)  # too soon after the last line: no line
    lines = capfd.readouterr().err.splitlines()
    assert [BEAT.match(line).groups() for line in lines] == [
        ("8", "1,000", "2.0 GB"),
        ("16", "2,000", "2.0 GB"),
        ("24", "3,000", "2.0 GB"),
    ]


def test_a_line_before_the_total_is_counted_says_the_eta_is_unknown(capfd):
    with RunProgress(None, "extract", heartbeat=0.01) as progress:
        time.sleep(0.02)
        progress.advance(1, 10, 0)
    line = capfd.readouterr().err.strip()
    assert line.startswith("extract: 1 samples, 10 tokens,") and line.endswith("ETA unknown")


def test_a_process_that_does_not_show_progress_prints_nothing(capfd):
    with RunProgress(lambda: 24, "extract", enabled=False, heartbeat=0.01) as progress:
        time.sleep(0.02)
        progress.advance(1, 10, 0)
    assert capfd.readouterr().err == ""


def _chatter() -> None:
    os.write(2, b"from C: loading shards 100%\n")
    os.write(1, b"to stdout\n")
    print("a Python log line")
    print("UserWarning: a library warning", file=sys.stderr)


def test_library_output_is_hidden_while_loading(capfd):
    with foreign_output_hidden():
        _chatter()
    print("ours")
    assert capfd.readouterr() == ("ours\n", "")


def test_a_handler_made_while_hidden_writes_to_stderr_afterwards_not_to_the_next_file_opened(capfd, tmp_path):
    # transformers binds its log handler to the sys.stderr it finds at import; under the hiding that was a
    # file on the hidden sink's descriptor number, which the run's next file (its shard journal) reused.
    with foreign_output_hidden():
        handler = logging.StreamHandler(sys.stderr)
    log = logging.getLogger("imported-while-hidden")
    log.addHandler(handler)
    # Descriptors are reused lowest first: a few files opened now include one on the sink's old number.
    paths = [tmp_path / f"journal{i}.jsonl" for i in range(8)]
    files = [open(path, "w") for path in paths]
    try:
        log.warning("Token indices sequence length is longer than the specified maximum")
    finally:
        log.removeHandler(handler)
        for f in files:
            f.close()
    assert [path.read_text() for path in paths] == [""] * len(paths)
    assert "Token indices sequence length" in capfd.readouterr().err


def test_bytes_written_through_sys_stdout_buffer_are_hidden_too(capfd):
    with foreign_output_hidden():
        sys.stdout.buffer.write(b"raw bytes from a library\n")
        sys.stdout.flush()
    print("ours")
    assert capfd.readouterr() == ("ours\n", "")


def test_library_output_is_shown_when_loading_fails(capfd):
    with pytest.raises(RuntimeError, match="load failed"):
        with foreign_output_hidden():
            _chatter()
            raise RuntimeError("load failed")
    out, err = capfd.readouterr()
    assert "from C: loading shards 100%" in err and "a library warning" in err and "to stdout" in err


def test_library_output_stays_hidden_when_the_run_is_stopped(capfd):
    # Ctrl-C (or SIGTERM) during the load replayed it all before the one line that says the run stopped.
    with pytest.raises(KeyboardInterrupt):
        with foreign_output_hidden():
            _chatter()
            raise KeyboardInterrupt
    print("ours")
    assert capfd.readouterr() == ("ours\n", "")


def test_verbose_shows_library_output_as_it_comes(capfd):
    with foreign_output_hidden(hide=False):
        _chatter()
    out, err = capfd.readouterr()
    assert "from C: loading shards 100%" in err and "to stdout" in out


def test_a_long_list_of_names_is_kept_to_one_short_line():
    from offline_extract.formatting import listing

    names = [f"shard_{i:03d}.safetensors" for i in range(374)]
    assert listing(names) == ", ".join(names[:5]) + " and 369 more"
    assert listing(names[:5]) == ", ".join(names[:5])


def test_the_count_column_shows_no_question_mark_while_the_total_is_unknown():
    from types import SimpleNamespace

    from offline_extract.lifecycle.progress import _Done

    assert _Done().render(SimpleNamespace(completed=15, total=None)).plain == "15"
    assert _Done().render(SimpleNamespace(completed=15, total=24)).plain == "15/24"


def test_records_after_the_last_batch_still_reach_the_bar():
    from offline_extract.summary import Tally

    tally = Tally(None, strict=False, nonfinite="fail")
    tally.resumed()  # a fully resumed run: records read, no batch ever formed
    tally.resumed()
    assert tally.records_read() == 2 and tally.records_read() == 0


def test_a_resumed_runs_token_count_says_it_is_this_attempts():
    # "records 3000: extracted 3000 (2008 by earlier attempts)" was followed by "tokens 538,879: ...", the
    # tokens of the 992 samples extracted now, read as the corpus's.
    from offline_extract.summary import Summary

    resumed = Summary(records=3, extracted=1, resumed=2, tokens=500, extract_seconds=2.0, seconds=3.0, shards=["s"])
    assert (
        resumed.report("out").splitlines()[1]
        == "tokens 500 extracted now: 250 tok/s over 2.0 s of extraction (3.0 s with start-up)"
    )
    whole = Summary(records=3, extracted=3, tokens=500, extract_seconds=2.0, seconds=3.0, shards=["s"])
    assert whole.report("out").splitlines()[1].startswith("tokens 500: 250 tok/s")


def test_outside_a_terminal_the_bar_is_one_whole_line(capfd):
    # Rich draws a file or a pipe the last frame only, cut at 80 columns: "dp 0/2 ━━━ 20000/20000 samples ... 0:00:…".
    with RunProgress(lambda: 20000, "dp 0/2") as progress:
        deadline = time.monotonic() + 10
        while progress.total is None and time.monotonic() < deadline:  # the count runs on a thread
            time.sleep(0.01)
        progress.advance(20000, 4_096_000, 328_600)
    line = capfd.readouterr().err.strip()
    assert re.fullmatch(
        r"dp 0/2 20,000/20,000 samples  [\d,]+ tok/s  328\.6 KB written \d:\d\d:\d\d ETA \d:\d\d:\d\d", line
    ), line


def test_counts_and_sizes_read_the_same_in_every_line():
    # "records 20000: extracted 20000" came before "tokens 538,879", and "1 new shard, 0.000 GB" after a bar
    # that said "328.6 KB written".
    from offline_extract.summary import Summary

    report = (
        Summary(
            records=20000,
            extracted=20000,
            tokens=538879,
            bytes_written=328_600,
            extract_seconds=2.0,
            seconds=3.0,
            shards=["s"],
        )
        .report("out")
        .splitlines()
    )
    assert report[0] == "records 20,000: extracted 20,000, skipped 0, rejected 0, dropped 0"
    assert report[1].startswith("tokens 538,879: 269,440 tok/s")
    assert report[2] == "1 new shard, 328.6 KB -> out"


def test_a_count_in_a_message_is_worded_with_its_thousands_grouped():
    from offline_extract.formatting import human_bytes, plural

    assert (plural(1, "shard"), plural(20000, "sample")) == ("1 shard", "20,000 samples")
    assert [human_bytes(n) for n in (999, 328_600, 4_300_000_000)] == ["999 B", "328.6 KB", "4.3 GB"]


def test_a_long_line_is_broken_to_the_terminals_width_and_left_whole_elsewhere(terminal, monkeypatch, capfd):
    # The start-up line ran to 600 characters, the terminal breaking it mid-word.
    from offline_extract.lifecycle.progress import note
    from offline_extract.formatting import WIDEST

    line = "start-up 12.5 s to the first forward: " + ", ".join(f"part {i} {i / 10:.1f} s" for i in range(40))
    fd, shown = terminal(80)
    with open(fd, "w") as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        note(line)
        note(f"one word wider than the terminal: /{'d' * 90}/shard_000.safetensors")
    shown = shown()
    assert len(shown) > 4 and all(len(row) <= 80 for row in shown[:-2]), shown
    assert " ".join(row.strip() for row in shown[:-2]) == line and shown[1].startswith("  ")
    assert not [row for row in shown if row[-1].isdigit()], "a figure is kept with its unit"
    assert shown[-2:] == ["one word wider than the terminal:", f"  /{'d' * 90}/shard_000.safetensors"]
    monkeypatch.undo()
    note(line)
    assert capfd.readouterr().err == line + "\n"  # a log keeps it one line
    fd, shown = terminal(300)
    with open(fd, "w") as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        note(line)
    shown = shown()
    assert max(len(row) for row in shown) <= WIDEST < 300
