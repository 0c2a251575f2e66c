"""benchmarks/feed_rate.py on the embedded model: the corpus fed as a run feeds it, on the feeding thread and on
a tokenizing process, gives the same records and tokens, and times the feeding thread's own CPU."""

import json
import subprocess
import sys

from extract_runs import ROOT


def test_the_fed_corpus_is_timed_on_the_thread_and_on_processes_alike(tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    args = ["--model", str(tiny_model_dir), "--data", str(ROOT / "examples" / "corpus.jsonl")]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "feed_rate.py"), *args, "--tokenizer-processes", "0"]
        + ["--tokenizer-processes", "1", "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    thread, apart = json.loads(out.read_text())["fed"]
    assert (thread["tokenizer_processes"], apart["tokenizer_processes"]) == (0, 1)
    assert thread["records"] == apart["records"] == 24 and thread["tokens"] == apart["tokens"] > 0
    for fed in (thread, apart):
        assert fed["tokens_s"] > 0 and fed["feeder_cpu_us_per_token"] == fed["feeder_cpu_s"] / fed["tokens"] * 1e6
