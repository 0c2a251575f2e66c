"""benchmarks/where_lost.py: a side's wall clock is its forwards, the GPU's idle before and between them, and
the tail; the extraction's extra seconds are attributed to the part that grew."""

import json
import sys

from extract_runs import ROOT

from benchmarks.where_lost import PARTS, main, where_lost


def _side(gpu_s, first, between, tail):
    return {
        "per_forward": {"gpu_s": gpu_s},
        "first_forward_s": first,
        "gpu_idle_between_forwards_s": between,
        "after_last_forward_s": tail,
        "wall_s": sum(gpu_s) + first + between + tail,
    }


def _result(bare, extract):
    return {
        "bare_ranks": [bare],
        "extract_ranks": [extract],
        "extract_over_bare": bare["wall_s"] / extract["wall_s"],
        "num_tokens": 1000,
        "num_samples": 3,
        "out_kind": "tmpfs",
        "store": "bf16",
        "compress": "none",
    }


def test_the_extra_seconds_land_in_the_part_that_grew(tmp_path, capsys, monkeypatch):
    r = where_lost(_result(_side([1.0, 1.0], 0.0, 0.0, 0.0), _side([1.0, 1.1], 0.01, 0.02, 0.5)))
    assert abs(r["lost_s"] - 0.63) < 1e-9
    assert {p: round(v, 9) for p, v in r["lost_by_part_s"].items()} == {
        "forwards": 0.1,
        "before_first": 0.01,
        "between": 0.02,
        "tail": 0.5,
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result(_side([2.0], 0.0, 0.0, 0.0), _side([2.0], 0.0, 0.0, 0.25))))
    monkeypatch.setattr(sys, "argv", ["where_lost.py", str(path), "--json", str(tmp_path / "out.json")])
    main(standalone_mode=False)
    assert "| r.json | 0.889 | 0.250 s | +0.000 s | +0.000 s | +0.000 s | +0.250 s |" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["command"].endswith(f"{path} --json {tmp_path / 'out.json'}")


def test_a_committed_h200_run_decomposes_into_its_parts():
    """The bench's own fields add up to its wall clock: the split explains every second of both sides."""
    result = json.loads(
        (
            ROOT / "benchmarks" / "results" / "peers-h200-20261201" / "peers_lognormal_sglang_engine_20261201-0629.json"
        ).read_text()
    )
    r = where_lost(result)
    for side in ("bare", "extract"):
        assert abs(r[side]["unexplained"]) < 1e-3 * r[side]["wall"], r[side]
    assert abs(sum(r["lost_by_part_s"][p] for p in PARTS) - r["lost_s"]) < 1e-3 * r["extract"]["wall"]
