"""benchmarks/checksum_throughput.py at tiny size: its rates come from the real check, and the kept verdicts
leave a second check nothing to hash."""

import json
import subprocess
import sys

from extract_runs import ROOT

from benchmarks.checksum_throughput import run
from offline_extract.store import verdicts


def test_rates_and_the_kept_check(tmp_path):
    result = run(files=2, gb_per_file=0.002, threads=2, repeats=1, work=tmp_path)
    for case in ("one_core_warm", "one_core_warm_block_sha256", "threads_warm", "threads_cold"):
        rate = result[case]
        assert rate["median_gb_s"] > 0, case
        assert abs(rate["seconds_for_100_gb_at_median"] * rate["median_gb_s"] / 100 - 1) < 0.05, case  # 100 GB
    assert sorted(json.loads((tmp_path / verdicts.VERDICTS_NAME).read_text())) == [
        "shard_000.safetensors",
        "shard_001.safetensors",
    ]
    assert result["kept_check_s_per_shard"] < result["first_check_s"]


def test_script_saves_its_command_with_the_result(tmp_path):
    out = tmp_path / "r.json"
    args = ["--files", "1", "--gb-per-file", "0.001", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "checksum_throughput.py"), *args], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["command"] == " ".join(["python benchmarks/checksum_throughput.py", *args])
    assert [p for p in tmp_path.iterdir() if p != out] == [], "its files are removed"
