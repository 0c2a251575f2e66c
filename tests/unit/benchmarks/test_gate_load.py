"""benchmarks/gate_load.py on CPU, on the embedded model: every part it times on the GPU runs, and the
comparison it times passes (the held states are HF's own)."""

import json
import sys

from benchmarks import gate_load


def test_gate_load_times_every_part_of_the_gates_hf_side(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "gate_load.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "gate_load.py",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--samples",
            "2",
            "--length",
            "24",
            "--json",
            str(out),
        ],
    )
    gate_load.main(standalone_mode=False)
    result = json.loads(out.read_text())
    files = sorted(tiny_model_dir.glob("*.safetensors"))
    assert result["checkpoint_bytes"] == sum(f.stat().st_size for f in files)
    for way in ("from_files", "read_ahead"):
        assert set(result[way]) >= {"config_s", "to_host_s", "to_device_s"} and min(result[way].values()) >= 0
    assert result["read_ahead"]["read_s"] > 0 and result["forwards_s"] >= result["first_forward_s"] > 0
    assert result["rows_ok"] and result["compare_s"] > 0
    # No pinned memory without CUDA: the two host-memory kinds only.
    assert set(result["copies"]) == {"mapped_to_device_s", "read_resident_s", "resident_to_device_s"}
