"""benchmarks/fp4_encodings.py on CPU, on the embedded model: every layer is judged in every encoding, the
stored layout's bytes follow from the formats, and the store's own codecs stand for fp8 and nvfp4."""

import json
import sys

from benchmarks import fp4_encodings

from offline_extract.testing.states import residual_like
from offline_extract.store.schema import Encoding

ROOT_CORPUS = "examples/corpus.jsonl"


def test_every_layer_and_encoding_is_measured_and_the_bytes_follow_from_the_formats(
    tiny_model_dir, tmp_path, monkeypatch
):
    out = tmp_path / "fp4.json"
    argv = ["fp4_encodings.py", "--model", str(tiny_model_dir), "--data", ROOT_CORPUS, "--samples", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--layers", "1,3,4", "--threads", "1", "--json", str(out)])
    fp4_encodings.main(standalone_mode=False)
    result = json.loads(out.read_text())
    assert result["samples"] == 3 and result["tokens"] > 0
    # The tiny Llama's 8 layers: 0..6 as they are, 7 before the final norm, then the post-norm final state.
    assert list(result["cosine_vs_bf16"]) == [*map(str, range(7)), "7 (pre-norm final)", "final (post-norm)"]
    for by_encoding in result["cosine_vs_bf16"].values():
        assert set(by_encoding) == set(fp4_encodings.ENCODINGS)
        assert all(0 < c["worst"] <= c["median"] <= 1 for c in by_encoding.values())
        assert by_encoding["fp8"]["worst"] > by_encoding["nvfp4"]["worst"]
    assert set(result["logits_vs_bf16"]) == {"bf16 vs float32 compute (the floor)", *fp4_encodings.ENCODINGS}
    # A token of 3 aux layers and the final state, 64 wide, its tokens' 6 bytes: bf16 518, fp8 278 (a float32
    # scale a layer), nvfp4 166 (32 bytes of codes, 4 of block scales and 4 of token scale a layer).
    sizes = result["bytes_per_token"]
    assert [sizes[key]["raw"] for key in ("aux bf16, final bf16", "aux fp8, final fp8", "aux nvfp4, final nvfp4")] == [
        518,
        278,
        166,
    ]
    assert sizes["aux nvfp4, final fp8"]["raw"] == 3 * 40 + 68 + 6


def test_the_store_encodings_are_the_stores_own():
    x = residual_like(20, 1, 64)
    for name in ("fp8", "nvfp4"):
        decoded, _, _ = fp4_encodings.ENCODINGS[name](x, 1)
        ours = Encoding(name, keeps_final_state=False)
        assert decoded.equal(ours.decode(ours.encode(x, None, 1))["aux_hidden_states"])
