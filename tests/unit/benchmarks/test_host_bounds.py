"""benchmarks/host_bounds.py at tiny size: every bound is measured, the repeated writes at the run's default
writer count come first, and nothing is left in the directory written to."""

import json
import subprocess
import sys

from extract_runs import ROOT

from offline_extract.options import DEFAULT_WRITERS


def test_every_bound_is_measured_and_its_files_removed(tmp_path):
    out, work = tmp_path / "r.json", tmp_path / "w"
    args = ["--dir", str(work), "--gb", "0.0625", "--copy-mb", "8", "--repeats", "2", "--bytes-per-token", "4613"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_bounds.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["command"].startswith("python benchmarks/host_bounds.py --dir")
    assert result["writers_repeated"] == DEFAULT_WRITERS
    assert len(result["write_bytes_s_repeated"]) == 2 and min(result["write_bytes_s_repeated"]) > 0
    assert sorted(result["write_bytes_s_by_writers"], key=int) == ["1", "2", "4", "8", "12"]
    assert min(result["write_bytes_s_by_writers"].values()) > 0 and min(result["copy_bytes_s_by_threads"].values()) > 0
    assert result["tokens_s"]["write_best"] == max(result["write_bytes_s_by_writers"].values()) / 4613
    assert not work.exists()
