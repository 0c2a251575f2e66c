"""A checkpoint's weight files: which HF loads, and a damaged index or safetensors file refused naming it."""

import json

import pytest
import torch


def test_a_checkpoints_size_is_that_of_the_files_hf_loads(tmp_path):
    # The read-ahead's memory check (extraction) and the gate-load benchmark each summed it themselves.
    from offline_extract.engine.checkpoint import checkpoint_bytes

    for name, size in (
        ("model-00001-of-00002.safetensors", 300),
        ("model-00002-of-00002.safetensors", 200),
        ("consolidated.safetensors", 5000),
    ):  # the last a copy no index names, which HF does not load
        (tmp_path / name).write_bytes(b"\0" * size)
    weight_map = {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors",
        "c": "model-00001-of-00002.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert checkpoint_bytes(str(tmp_path)) == 500
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 70)
    assert checkpoint_bytes(str(tmp_path)) == 70


ADVICE = "it is damaged, or was cut short by an interrupted download or copy. Download or copy it again, then re-run"


@pytest.mark.parametrize(
    "content, why",
    [
        # Cut short mid-download: the string that opens at line 5, column 26 never ends.
        (
            '{\n  "metadata": {},\n  "weight_map": {\n    "lm_head.weight": "model.safetensors",\n    "model.norm.weight": '
            '"model.safe',
            "is not valid JSON (Unterminated string starting at: line 5 column 26 (char 106))",
        ),
        ("", "is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        (
            b"\xff\xd8\xff\xe0",
            "is not valid JSON ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)",
        ),
        ('{"metadata": {"total_size": 12}}', 'has no "weight_map" object naming the file of each tensor'),
        ('[{"weight_map": {"a": "model.safetensors"}}]', 'has no "weight_map" object naming the file of each tensor'),
        ('{"weight_map": ["model.safetensors"]}', 'has no "weight_map" object naming the file of each tensor'),
        ('{"weight_map": {"a": 1}}', 'has no "weight_map" object naming the file of each tensor'),
        ('{"weight_map": {}}', 'has no "weight_map" object naming the file of each tensor'),
    ],
)
def test_a_damaged_checkpoint_index_is_refused_naming_it_where_it_breaks_and_what_to_do(content, why, tmp_path):
    # json's bare "Expecting value: line 1 column 1 (char 0)" named no file; one without a weight_map, a KeyError.
    from offline_extract.engine.checkpoint import CHECKPOINT_INDEX, checkpoint_files

    index = tmp_path / CHECKPOINT_INDEX
    index.write_bytes(content if isinstance(content, bytes) else content.encode())
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 70)  # the index is read, not passed over for it
    with pytest.raises(ValueError) as refused:
        checkpoint_files(str(tmp_path))
    assert str(refused.value) == f"{index} {why}: {ADVICE}"


def _header_edited(edit):
    """A damage to a safetensors file's header that keeps it JSON: `edit` changes the parsed header."""

    def damage(raw: bytes) -> bytes:
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + length])
        edit(header)
        text = json.dumps(header).encode()
        return len(text).to_bytes(8, "little") + text + raw[8 + length :]

    return damage


DAMAGES = {
    "cut short in its tensors": lambda raw: raw[: len(raw) // 2],
    "cut short in its header": lambda raw: raw[:20],
    "cut short in its length": lambda raw: raw[:5],
    "a byte past its tensors": lambda raw: raw + b"\0",
    "zeroed": lambda raw: bytes(len(raw)),
    "a length past the file's end": lambda raw: (len(raw)).to_bytes(8, "little") + raw[8:],
    "a header that is not JSON": lambda raw: raw[:8] + b"#" + raw[9:],
    "a shape that does not fit": _header_edited(lambda h: h["b"].update(shape=[3])),
    "a tensor without a dtype": _header_edited(lambda h: h["a"].pop("dtype")),
    "overlapping tensors": _header_edited(
        lambda h: h["b"].update(data_offsets=[h["b"]["data_offsets"][0] - 2, h["b"]["data_offsets"][1] - 2])
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_safetensors_file_is_refused_naming_it(damage, tmp_path):
    # safetensors' own check, named by file: SGLang's load failed on each of these with a traceback naming none.
    from safetensors import safe_open
    from safetensors.torch import save_file

    from offline_extract.engine.checkpoint import WeightsUnreadable, check_safetensors

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(3, 5), "b": torch.ones(4, dtype=torch.bfloat16)}, str(path), metadata={"format": "pt"})
    raw = path.read_bytes()
    check_safetensors(path)
    path.write_bytes(DAMAGES[damage](raw))
    with pytest.raises(Exception):  # noqa: B017  safetensors' own type differs with the damage
        safe_open(path, framework="pt")
    with pytest.raises(WeightsUnreadable) as refused:
        check_safetensors(path)
    assert str(refused.value).startswith(f"{path} is not a whole safetensors file (")
    assert str(refused.value).endswith(
        "): it is damaged, or was cut short by an interrupted download or copy. Download or copy it again, then re-run"
    )


class _RunsCode:
    """What a malicious pickle holds: unpickled, it calls a function of the file's choosing."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_weight_file_holding_more_than_tensors_is_refused_in_one_line_without_running_it(tmp_path):
    from offline_extract.engine.checkpoint import check_pickled_weights

    weights = {"w": torch.ones(2, 3)}
    torch.save(weights, tmp_path / "pytorch_model.bin")
    # What HF's Trainer pickles beside the weights is no weight file: SGLang's loader leaves it out, and so does this.
    torch.save({"args": _RunsCode(tmp_path / "args-ran")}, tmp_path / "training_args.bin")
    check_pickled_weights(tmp_path)
    torch.save({**weights, "evil": _RunsCode(tmp_path / "ran")}, tmp_path / "pytorch_model-00002-of-00002.bin")
    with pytest.raises(ValueError) as refused:
        check_pickled_weights(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path / 'pytorch_model-00002-of-00002.bin'} holds pickled objects beyond tensors (io.open), which are "
        f"refused: loading them would run code the file names. Use a checkpoint of safetensors weights, or convert "
        f"this one's tensors where you trust its source"
    )
    assert not (tmp_path / "ran").exists() and not (tmp_path / "args-ran").exists()
    # Beside safetensors weights, SGLang loads only those: the pickles are not read.
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_pickled_weights(tmp_path)
