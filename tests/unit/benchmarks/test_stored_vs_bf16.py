"""benchmarks/stored_vs_bf16.py on synthetic outputs of the same states in three stores."""

import json
import sys

from benchmarks import stored_vs_bf16

from offline_extract.testing.shards import write_synthetic


def test_stored_vs_bf16_compares_each_run_with_the_bf16_one_layer_by_layer(tmp_path, monkeypatch):
    outs = {}
    for store in ("bf16", "fp8", "nvfp4"):
        outs[store] = tmp_path / store
        write_synthetic(outs[store], [40, 70, 25], hidden_size=256, num_aux=3, layer_ids=(1, 3, 4), store=store)
    result_path = tmp_path / "result.json"
    argv = ["stored_vs_bf16.py", "--reference", str(outs["bf16"]), str(outs["fp8"]), str(outs["nvfp4"])]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(result_path)])
    stored_vs_bf16.main(standalone_mode=False)
    runs = json.loads(result_path.read_text())["runs"]
    fp8, nvfp4 = runs[str(outs["fp8"])], runs[str(outs["nvfp4"])]
    assert fp8["tokens"] == nvfp4["tokens"] == 135
    assert list(nvfp4["cosine_vs_bf16"]) == ["layer 1", "layer 3", "layer 4", "final (post-norm)"]
    for name, fp8_layer in fp8["cosine_vs_bf16"].items():
        assert 0.999 <= fp8_layer["worst"] <= fp8_layer["median"] < 1
        assert 0.98 <= nvfp4["cosine_vs_bf16"][name]["worst"] < fp8_layer["worst"]
    assert nvfp4["of_bf16"] < 0.32 < 0.5 < fp8["of_bf16"] < 0.53
