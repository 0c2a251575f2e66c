"""benchmarks/main_job.py's inputs: the real-English corpus the model-class benches run on is the standard library's
docstrings, the same records on every run of one Python, texts and chats in turn, as bin/extract.py reads them."""

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from benchmarks.main_job import main
from offline_extract.data.corpus import Record, read_corpus


def test_the_docstring_corpus_is_the_same_records_every_time_texts_and_chats_in_turn(tmp_path):
    first, again = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path in (first, again):
        result = CliRunner().invoke(main, ["docstrings", str(path), "--records", "6"])
        assert result.exit_code == 0, result.output
    assert first.read_bytes() == again.read_bytes()
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["chat-0", "doc-1", "chat-2", "doc-3", "chat-4", "doc-5"]
    assert [r["messages"][1]["role"] for r in rows[::2]] == ["assistant"] * 3
    assert all(len(r["text"]) > 6 * 200 for r in rows[1::2]), "six docstrings of more than 200 characters each"
    records = [r for r in read_corpus([str(first)]) if isinstance(r, Record)]
    assert [r.id for r in records] == [r["id"] for r in rows]


def test_stacks_samples_every_threads_stack_headed_by_its_seconds(tmp_path):
    """`stacks` runs a script with its threads' stacks sampled as it goes, a worker thread's among them, so that a
    cold start's seconds can be put on the functions that spent them."""
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, threading, time\n"
        "def waiting_in_a_thread():\n    time.sleep(1.5)\n"
        "def waiting_in_main():\n    time.sleep(1.5)\n"
        "threading.Thread(target=waiting_in_a_thread, name='worker').start()\n"
        "waiting_in_main()\n"
        "print(sys.argv[1:])\n"
    )
    out = tmp_path / "stacks.txt"
    main_job = Path(__file__).resolve().parents[3] / "benchmarks" / "main_job.py"
    env = {**os.environ, "OE_STACKS": str(out), "OE_STACKS_EVERY": "0.3"}
    run = subprocess.run(
        [sys.executable, str(main_job), "stacks", str(script), "--an-option", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "['--an-option', 'x']"
    samples = out.read_text().split("Sample at ")[1:]
    assert len(samples) >= 3, out.read_text()
    seconds = [float(s.split(" s:", 1)[0]) for s in samples]
    assert seconds == sorted(seconds) and seconds[0] >= 0.3
    assert "Thread worker (most recent call first):" in samples[1] and "in waiting_in_a_thread" in samples[1]
    assert "Thread MainThread (most recent call first):" in samples[1] and "in waiting_in_main" in samples[1]
