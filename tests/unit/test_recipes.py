import numpy as np
import pytest

from offline_extract.data.corpus import Record
from offline_extract.data.tokenization import SampleTokenizer, longest_loss_run
from offline_extract.recipes import RECIPES, spread_layer_ids


@pytest.mark.parametrize(
    "num_layers, ids",
    [
        (36, (1, 9, 17, 25, 33)),  # Qwen3-8B, the layers of SpecForge's DFlash config for it
        (32, (1, 8, 15, 22, 29)),  # Llama-3.1-8B
        (10, (1, 2, 4, 6, 7)),  # 2.5 and 5.5 round half to even, as DFlash's own choice does
        (8, (1, 2, 3, 4, 5)),
    ],
)
def test_dflash_layers_spread_evenly_over_1_to_n_minus_3(num_layers, ids):
    assert RECIPES["dflash"].layer_ids(num_layers) == ids == RECIPES["dspark"].layer_ids(num_layers)
    assert max(ids) < num_layers - 1, "the last layer's output is not capturable"


def test_one_layer_is_the_middle_one_and_a_shallow_model_is_refused():
    assert spread_layer_ids(36, 1) == (18,)
    with pytest.raises(ValueError, match="6 decoder layers is too shallow for 5 distinct layers.*--layers"):
        spread_layer_ids(6, 5)


def test_recipes_differ_in_final_state_and_sample_rule():
    assert RECIPES["eagle3"].layer_ids(32) is None  # SGLang's own default, resolved by the engine
    assert [RECIPES[r].keeps_final_state for r in ("eagle3", "dflash", "dspark")] == [True, False, True]
    assert RECIPES["eagle3"].min_loss_run == 0 and RECIPES["dflash"].min_loss_run == RECIPES["dspark"].min_loss_run > 0


def test_longest_loss_run():
    assert longest_loss_run(np.array([0, 1, 1, 0, 1, 1, 1, 0], dtype=np.uint8)) == 3
    assert longest_loss_run(np.array([1, 1], dtype=np.uint8)) == 2
    assert longest_loss_run(np.zeros(4, dtype=np.uint8)) == 0
    assert longest_loss_run(np.zeros(0, dtype=np.uint8)) == 0


def test_samples_without_a_long_enough_loss_run_are_skipped_with_the_reason(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=4096, min_loss_run=4)

    def record(mask):
        return Record(
            source="c.jsonl",
            line=7,
            index=6,
            id="s",
            format="tokens",
            input_ids=(5,) * len(mask),
            loss_mask=tuple(mask),
        )

    assert tok(record([0, 1, 1, 1, 1, 0])).num_tokens == 6
    reject = tok(record([1, 1, 1, 0, 1, 1, 1, 0, 1]))  # 7 loss tokens, but no 4 in a row
    assert reject.kind == "skipped" and (reject.line, reject.id) == (7, "s")
    assert reject.reason == "its longest run of consecutive loss tokens is 3, fewer than --min-loss-run 4"
