"""The shard writer at a real run's scale on the engine's own states (run with `-m gpu`): a file of its own,
since each case runs a 380k-token extraction and reads all of it back (minutes), and can run beside
test_gpu.py on a second GPU."""

import subprocess
import sys

import pytest
from extract_runs import ROOT

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("store, compress, writers", [("bf16", "none", 8), ("fp8", "zstd", 4)])
def test_llama3_8b_shaped_run_reads_back_every_byte_the_feed_handed_to_the_writer(
    llama3_8b, tmp_path, store, compress, writers
):
    """The writer at a real run's scale (tests/gpu/written_back.py): 250k tokens of lognormal samples and
    one of 131,072 tokens streamed, 512 MiB shards, 64 MiB blocks and tail parts, on the engine's own
    states; the shards, index, training reader and inspect --verify's check give back every byte the feed
    handed over, in order, and every journaled checksum is its file's. In a process of its own, as the
    engine keeps its GPU memory until its process ends."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "gpu" / "written_back.py"),
            "--model",
            str(llama3_8b),
            "--out",
            str(tmp_path / "out"),
            "--store",
            store,
            "--compress",
            compress,
            "--writers",
            str(writers),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.splitlines()[-1].startswith("ok: "), proc.stdout[-2000:]
