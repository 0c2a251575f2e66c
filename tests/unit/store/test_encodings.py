"""--store bf16|fp8|nvfp4 (and nvfp4 with its final state in fp8) and --compress none|zstd: every combination
written, read back through the datasets, exported, summarized and verified; the states agree with what was
given to the writer, through the store's round trip."""

import json

import pytest
import torch
from safetensors import safe_open

from offline_extract.store import integrity, manifest
from offline_extract.store.inspection import summarize
from offline_extract.store.journal import Journal
from offline_extract.options import choices
from offline_extract.store.schema import METADATA_KEY, STORES, Encoding, RunInfo, SampleInfo, ShardError
from offline_extract.store.index import iter_samples, shard_paths
from offline_extract.store.shard import open_shard
from offline_extract.store.writer import ShardWriter
from offline_extract.testing.shards import synthetic_run, write_samples
from offline_extract.training.datasets import HiddenStateDataset, HiddenStateIterableDataset
from offline_extract.training.export import export_specforge, specforge_path

K, H = 3, 256
LENGTHS = [5, 17, 1, 30, 8, 12, 3]
COMBINATIONS = [Encoding(store, compress) for store in STORES for compress in choices("compress")] + [
    Encoding("nvfp4", compress, final_store="fp8") for compress in choices("compress")
]


def name_of(encoding: Encoding) -> str:
    return "-".join(
        [encoding.store, *([f"final-{encoding.final_store}"] if encoding.final_store else []), encoding.compress]
    )


def states(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (aux, last) for every token, with outlier channels and per-token scales like real ones."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(LENGTHS)
    x = torch.randn(tokens, K + 1, H, generator=g)
    x[..., :2] *= 50
    x *= torch.rand(tokens, K + 1, 1, generator=g) * 4 + 0.1
    x = x.bfloat16()
    return x[:, :K].reshape(tokens, K * H), x[:, K]


def run_of(encoding: Encoding) -> RunInfo:
    return synthetic_run(
        (1, 3, 4),
        H,
        store=encoding.store,
        final_store=encoding.final_store,
        compress=encoding.compress,
        final_state="post-norm" if encoding.keeps_final_state else None,
    )


def write(out, encoding: Encoding, shard_bytes: int = 20 * (K + 1) * H * 2) -> None:
    """Shards of LENGTHS samples in `encoding`, with manifest and index, as a run leaves them."""
    out.mkdir(parents=True, exist_ok=True)
    aux, last = states()
    input_ids = torch.randint(0, 1000, (len(aux),), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    with Journal(manifest.journal_path(out, 0)) as journal:
        write_samples(
            out,
            run_of(encoding),
            LENGTHS,
            input_ids,
            torch.ones(len(aux), dtype=torch.uint8),
            aux,
            last,
            shard_bytes=shard_bytes,
            on_written=lambda w: journal.append(vars(w)),
        )
    manifest.consolidate(out, identity={"layer_ids": [1, 3, 4]}, status="complete")


def expected(encoding: Encoding) -> dict[str, dict[str, torch.Tensor]]:
    """What a reader must hand out: the bf16 states as given, or their round trip through the store's codec."""
    aux, last = states()
    decoded = encoding.decode(encoding.encode(aux, last, K))
    aux, last = decoded["aux_hidden_states"], decoded.get("hidden_states", last)
    bounds = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    return {
        f"s{i}": {"aux_hidden_states": aux[a:b], "hidden_states": last[a:b]}
        for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    }


@pytest.fixture(scope="module", params=COMBINATIONS, ids=name_of)
def written(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(name_of(request.param))
    write(out, request.param)
    assert len(shard_paths(out)) > 1
    return request.param, out


def test_readers_hand_out_the_states_given_decoded_to_bf16(written):
    encoding, out = written
    want = expected(encoding)
    ds = HiddenStateDataset(out)
    assert ds.ids == [f"s{i}" for i in range(len(LENGTHS))]
    streamed = {item["id"]: item for item in HiddenStateIterableDataset(out, seed=3)}
    for i in range(len(ds)):
        item = ds[i]
        for name, t in want[item["id"]].items():
            assert item[name].dtype == torch.bfloat16
            assert torch.equal(item[name], t), (item["id"], name)
            assert torch.equal(streamed[item["id"]][name], t)
            # The sample's own storage, not a view of a decoded or mapped shard.
            assert item[name].untyped_storage().nbytes() == item[name].nbytes
    for info, tensors in iter_samples(out):
        assert torch.equal(tensors["aux_hidden_states"], want[info.id]["aux_hidden_states"])


def test_shards_stay_safetensors_and_name_their_encoding(written):
    encoding, out = written
    path = shard_paths(out)[0]
    with safe_open(path, framework="pt") as f:
        document = json.loads(f.metadata()[METADATA_KEY])
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert "encoding" not in document, "a shard's encoding is recorded once, as its run's facts"
    run = document["run"]
    assert (run["store"], run["final_store"], run["compress"], run["final_state"]) == (
        encoding.store,
        encoding.final_store,
        encoding.compress,
        "post-norm",
    )
    values = {"bf16": "BF16", "fp8": "F8_E4M3", "nvfp4": "U8"}
    for state, store in (
        ("aux_hidden_states", encoding.store),
        ("hidden_states", encoding.final_store or encoding.store),
    ):
        if encoding.compress == "zstd":
            assert dtypes[state] == "U8" and dtypes[state + "_frames"] == "I64"
        else:
            assert dtypes[state] == values[store]
        # The scales per token stay raw under zstd; nvfp4's block scales are compressed with the values.
        assert dtypes.get(state + "_scale") == (None if store == "bf16" else "F32")
        block_scales = {"nvfp4": "U8" if encoding.compress == "zstd" else "F8_E4M3"}.get(store)
        assert dtypes.get(state + "_block_scale") == block_scales
    assert open_shard(path).encoding == encoding


def test_export_inspect_and_verify_read_every_combination(written, tmp_path):
    encoding, out = written
    assert integrity.verify(out).problems == []
    summary = summarize(out)
    assert summary["encoding"] == encoding.to_json() and summary["num_aux_layers"] == K
    assert [layer["name"] for layer in summary["layer_stats"]] == ["layer 1", "layer 3", "layer 4", "last (post-norm)"]
    export_specforge(out, tmp_path / "sf", gzipped=False, progress=False)  # the plain files, to read them here
    want = expected(encoding)
    for i in range(len(LENGTHS)):
        data = torch.load(specforge_path(tmp_path / "sf", i), weights_only=True)
        assert torch.equal(data["aux_hidden_state"][0], want[f"s{i}"]["aux_hidden_states"])
        assert torch.equal(data["hidden_state"][0], want[f"s{i}"]["hidden_states"])


@pytest.mark.parametrize(
    "encoding, share, cosine",
    [
        (Encoding("fp8"), 0.52, 0.999),
        # A token's states take 0.29 of bf16's bytes at H = 256 (0.5 + 1/16 bytes an element, 4 a layer); these
        # shards of 76 tokens carry their metadata too.
        (Encoding("nvfp4"), 0.31, 0.98),
        (Encoding("nvfp4", final_store="fp8"), 0.36, 0.98),
    ],
    ids=lambda v: name_of(v) if isinstance(v, Encoding) else str(v),
)
def test_a_quantized_store_cuts_the_bytes_and_keeps_every_tokens_direction(tmp_path, encoding, share, cosine):
    sizes = {}
    for name, e in (("bf16", Encoding()), ("quantized", encoding)):
        write(tmp_path / name, e, shard_bytes=1 << 30)
        sizes[name] = sum(p.stat().st_size for p in shard_paths(tmp_path / name))
    assert sizes["quantized"] <= share * sizes["bf16"], sizes
    got, bf16 = expected(encoding), expected(Encoding())
    for sid in got:
        for name in ("aux_hidden_states", "hidden_states"):
            a, b = got[sid][name].float(), bf16[sid][name].float()
            layers = a.shape[1] // H
            cos = torch.nn.functional.cosine_similarity(a.reshape(-1, layers, H), b.reshape(-1, layers, H), dim=-1)
            least = 0.999 if name == "hidden_states" and encoding.final_store == "fp8" else cosine
            assert cos.min() >= least, (sid, name, cos.min())


def test_zstd_is_lossless_and_smaller(tmp_path):
    for store in STORES:
        write(tmp_path / store, Encoding(store), shard_bytes=1 << 30)
        write(tmp_path / f"{store}-zstd", Encoding(store, "zstd"), shard_bytes=1 << 30)
        plain = sum(p.stat().st_size for p in shard_paths(tmp_path / store))
        packed = sum(p.stat().st_size for p in shard_paths(tmp_path / f"{store}-zstd"))
        assert packed < plain, (store, packed, plain)


def test_a_recipe_without_final_state_stores_none(tmp_path):
    encoding = Encoding("fp8", "zstd", keeps_final_state=False)
    write(tmp_path, encoding)
    item = HiddenStateDataset(tmp_path)[0]
    assert set(item) == {"input_ids", "loss_mask", "image_mask", "aux_hidden_states", "id"}
    assert torch.equal(item["aux_hidden_states"], expected(encoding)["s0"]["aux_hidden_states"])
    with safe_open(shard_paths(tmp_path)[0], framework="pt") as f:
        assert not any(name.startswith("hidden_states") for name in f.keys())
    assert integrity.verify(tmp_path).problems == []
    assert [layer["name"] for layer in summarize(tmp_path)["layer_stats"]] == ["layer 1", "layer 3", "layer 4"]


def _rewrite(path, name: str, change) -> None:
    """Changes one tensor of a shard in place (same bytes count), as damage on disk would."""
    with safe_open(path, framework="pt") as f:
        tensor = f.get_tensor(name)
        header_len = 8 + int.from_bytes(path.read_bytes()[:8], "little")
        start = json.loads(path.read_bytes()[8:header_len])[name]["data_offsets"][0]
    change(tensor)
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    data[header_len + start : header_len + start + len(raw)] = raw
    path.write_bytes(bytes(data))


def test_verify_reports_scales_that_are_not_finite_and_positive(tmp_path):
    write(tmp_path, Encoding("fp8"))
    path = shard_paths(tmp_path)[0]

    def damage(scales):
        scales[2, 1] = -scales[2, 1]
        scales[3, 0] = float("nan")

    _rewrite(path, "aux_hidden_states_scale", damage)
    problems = integrity.verify(tmp_path).problems
    assert any(f"{path.name}: 2 aux_hidden_states_scale values are not finite and positive" in p for p in problems), (
        problems
    )


def test_verify_reports_damaged_zstd_frames(tmp_path):
    write(tmp_path, Encoding("bf16", "zstd"))
    path = shard_paths(tmp_path)[0]
    # Sample 1's frame now starts 3 bytes into it: no frame header there.
    _rewrite(path, "hidden_states_frames", lambda frames: frames.__setitem__(1, frames[1] + 3))
    problems = integrity.verify(tmp_path).problems
    assert any(
        f"{path.name}: hidden_states frame of sample position 1 does not hold its 17 rows" in p for p in problems
    ), problems


def test_a_flipped_byte_in_a_zstd_frame_fails_its_read_by_the_frames_checksum(tmp_path):
    write(tmp_path, Encoding("bf16", "zstd"))
    path = shard_paths(tmp_path)[0]
    frames = open_shard(path).tensor("aux_hidden_states_frames").tolist()
    middle = (frames[1] + frames[2]) // 2  # inside sample 1's compressed bytes: its frame header stays whole

    def flip(blob):
        blob[middle] ^= 1

    _rewrite(path, "aux_hidden_states", flip)
    shard = open_shard(path)
    shard.sample(0)  # the other frames are whole
    with pytest.raises(ShardError, match=rf"{path}: the aux_hidden_states frame of sample position 1 is damaged"):
        shard.sample(1)


@pytest.mark.parametrize(
    "encoding",
    [Encoding("fp8"), Encoding("bf16", "zstd"), Encoding("fp8", "zstd"), Encoding("nvfp4", "zstd", final_store="fp8")],
    ids=name_of,
)
def test_a_long_sample_filled_in_pieces_is_stored_in_the_encoding(tmp_path, encoding):
    """The chunked path (begin_sample): the staged rows of a long sample, scales included, arrive
    piece by piece; a compressed shard is written once whole, not streamed."""
    aux, last = states()
    n = LENGTHS[3]
    a, b = sum(LENGTHS[:3]), sum(LENGTHS[:4])
    staged = encoding.encode(aux[a:b], last[a:b], K)
    writer = ShardWriter(tmp_path, run_of(encoding), shard_bytes=8 * (K + 1) * H * 2)
    rows = writer.begin_sample(
        SampleInfo(3, "s3", "synthetic", 4, n, False),
        torch.arange(n, dtype=torch.int32),
        torch.ones(n, dtype=torch.uint8),
        {k: t.shape[1] for k, t in staged.items()},
        stream=True,
    )
    assert sorted(rows) == sorted(staged)
    for start in range(0, n, 7):
        for name, t in staged.items():
            rows[name][start : start + 7].copy_(t[start : start + 7])
        writer.filled(min(start + 7, n))
    writer.end_sample()
    writer.close()
    item = open_shard(shard_paths(tmp_path)[0]).sample(0)
    assert torch.equal(item["aux_hidden_states"], expected(encoding)["s3"]["aux_hidden_states"])
    assert torch.equal(item["hidden_states"], expected(encoding)["s3"]["hidden_states"])


def test_verify_takes_a_zero_block_scale_and_reports_a_negative_or_non_finite_one(tmp_path):
    """A block far below its token's largest rounds its scale to zero and decodes to zeros, as the codec means;
    a negative or NaN scale is damage."""
    write(tmp_path, Encoding("nvfp4"))
    path = shard_paths(tmp_path)[0]
    _rewrite(path, "aux_hidden_states_block_scale", lambda scales: scales[1].view(torch.uint8).fill_(0))
    problems = integrity.verify(tmp_path).problems
    assert problems and not any("block_scale" in p for p in problems), problems  # the checksum's alone

    def damage(scales):
        scales.view(torch.uint8)[2, 0] = 0xB8  # -1.0 in e4m3
        scales.view(torch.uint8)[7, 5] = 0x7F  # NaN

    _rewrite(path, "aux_hidden_states_block_scale", damage)
    problems = integrity.verify(tmp_path).problems
    assert any(
        f"{path.name}: 2 aux_hidden_states_block_scale values are not finite and non-negative, in samples at "
        "positions [0, 1]" in p
        for p in problems
    ), problems
