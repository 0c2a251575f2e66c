"""The options module: each choice stated once, checked once, and the tables keyed by it agree with it."""

import os
import re
from dataclasses import MISSING, fields
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from offline_extract.commands.extract import SECTIONS
from offline_extract.commands.extract import main as extract_command
from offline_extract.engine.distributed import Layout
from offline_extract.extraction import engine_config
from offline_extract.default_model import TINY_VERSION, default_cache_dir
from offline_extract.engine.kernels import JIT_CACHES, use_jit_cache
from offline_extract.options import FINAL_STATES, GROUPS, ExtractOptions, cache_root, choices, default
from offline_extract.recipes import RECIPES
from offline_extract.store.schema import STORES


@pytest.mark.parametrize(
    "option, value",
    [
        ("recipe", "eagle4"),
        ("store", "fp4"),
        ("compress", "lz4"),
        ("final_state", "mid-norm"),
        ("nonfinite", "ignore"),
        ("overlong", "wrap"),
        ("dtype", "int8"),
        ("device", "tpu"),
    ],
)
def test_a_value_outside_a_choice_is_refused_when_the_options_are_made(option, value):
    with pytest.raises(ValueError) as refused:
        ExtractOptions(data=("c.jsonl",), **{option: value})
    assert str(refused.value) == f"{option} must be one of {', '.join(choices(option))}, got {value!r}"


def test_the_tables_keyed_by_a_choice_have_exactly_its_values():
    assert tuple(RECIPES) == choices("recipe")
    assert tuple(STORES) == choices("store")
    assert tuple(FINAL_STATES) == choices("final_state")


def test_the_command_line_offers_the_options_choices_and_defaults():
    params = {p.name: p for p in extract_command.params}
    offered = {name: tuple(p.type.choices) for name, p in params.items() if isinstance(p.type, click.Choice)}
    assert offered == {name: choices(name) for name in offered}
    assert set(offered) == {f.name for f in fields(ExtractOptions) if f.name in _choice_fields()}
    # Every field is an option of the command, by its own name, with its own default (--shard-size-mb in MiB).
    assert set(params) == {f.name for f in fields(ExtractOptions)} | {"dry_run", "version"}
    for f in fields(ExtractOptions):
        unit = f.metadata["cli"].unit
        if f.default is not MISSING and f.default is not None and not isinstance(f.default, bool):
            assert params[f.name].default * unit == default(f.name), f.name
    assert params["shard_bytes"].opts == ["--shard-size-mb"] and params["progress"].opts == ["--no-progress"]


def test_help_lists_every_option_once_in_its_section():
    grouped = [f.name for group in GROUPS for f in fields(group)]
    assert grouped == [f.name for f in fields(ExtractOptions)], "each option in one group, in the groups' order"
    text = CliRunner().invoke(extract_command, ["--help"], terminal_width=200).output
    titles = [f"{title}:" for title in GROUPS.values()]
    assert [line for line in text.splitlines() if line in titles] == titles, text
    for f in fields(ExtractOptions):
        (section,) = [title for title, names in SECTIONS.items() if f.name in names]
        flag = extract_command.params[[p.name for p in extract_command.params].index(f.name)].opts[0]
        (row,) = [m.start() for m in re.finditer(rf"^  {re.escape(flag)}\b", text, flags=re.M)]
        assert text.index(f"{section}:") < row, (flag, section)


# The options the command line reads as floats, each with a value it takes.
_FLOATS = {"--shard-size-mb": "1.5", "--mem-fraction-static": "0.5", "--progress-every": "10"}


def test_the_float_options_are_the_ones_read_as_floats():
    floats = {p.opts[0] for p in extract_command.params if isinstance(p.type, click.types.FloatParamType)}
    assert floats == set(_FLOATS)


@pytest.mark.parametrize("flag", sorted(_FLOATS))
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_a_float_option_that_is_not_a_finite_number_is_a_usage_error(flag, value):
    result = CliRunner().invoke(extract_command, ["--data", "c.jsonl", flag, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}': " in result.output and "Traceback" not in result.output
    assert "not a finite number" in result.output or "is not in the range" in result.output
    # A finite value of the same option is taken: the refusal is the value's.
    taken = extract_command.make_context("extract", ["--data", "c.jsonl", flag, _FLOATS[flag]])
    name = next(p.name for p in extract_command.params if p.opts[0] == flag)
    unit = next(f.metadata["cli"].unit for f in fields(ExtractOptions) if f.name == name)
    assert taken.params[name] == float(_FLOATS[flag]) * unit


def _choice_fields() -> set[str]:
    names = set()
    for f in fields(ExtractOptions):
        try:
            choices(f.name)
        except KeyError:
            continue
        names.add(f.name)
    return names


def test_the_engine_config_is_the_options_mapped_once():
    opts = ExtractOptions(
        data=(),
        model="m",
        dtype="bfloat16",
        tp=2,
        max_length=9000,
        chunk_tokens=4096,
        seqs_per_batch=64,
        attention_backend="triton",
        load_format="dummy",
        mem_fraction_static=0.5,
        port_base=30000,
        final_state="pre-norm",
        trust_remote_code=True,
        jit_cache="/cache",
    )
    layout = Layout(rank=3, world_size=4, local_rank=3, local_world_size=4, tp_size=2)  # dp 1, tp 1
    cfg = engine_config(opts, layout, Path("/models/m"), "cuda", 8192, (1, 2))
    assert (cfg.model_path, cfg.device, cfg.dtype) == ("/models/m", "cuda", "bfloat16")
    assert (cfg.tp_size, cfg.tp_rank, cfg.gpu_id, cfg.nccl_port) == (2, 1, 3, 30001)
    assert (cfg.max_tokens_per_batch, cfg.max_seqs_per_batch, cfg.chunk_tokens, cfg.context_length) == (
        8192,
        64,
        4096,
        9000,
    )
    assert (cfg.attention_backend, cfg.load_format, cfg.mem_fraction_static) == ("triton", "dummy", 0.5)
    assert (cfg.layer_ids, cfg.final_state, cfg.trust_remote_code, cfg.jit_cache) == (
        (1, 2),
        "pre-norm",
        True,
        "/cache",
    )


def test_a_writing_rank_under_torchrun_copies_with_its_share_of_the_cores(monkeypatch):
    """torchrun leaves every rank one intra-op thread; the host copies into shard buffers then ran on one
    core a rank. A writing rank gets the node's cores over its processes; a lone process keeps torch's
    own count, as do TP ranks that write nothing and engines on CPU (whose forward the threads run)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    opts = ExtractOptions(data=(), tp=2)
    writing, silent = (Layout(rank=r, world_size=4, local_rank=r, local_world_size=4, tp_size=2) for r in (2, 3))
    assert engine_config(opts, writing, Path("/m"), "cuda", 8192, None).host_threads == 8
    assert engine_config(opts, silent, Path("/m"), "cuda", 8192, None).host_threads is None
    assert engine_config(opts, writing, Path("/m"), "cpu", 8192, None).host_threads is None
    assert engine_config(ExtractOptions(data=()), Layout(), Path("/m"), "cuda", 8192, None).host_threads is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert engine_config(opts, writing, Path("/m"), "cuda", 8192, None).host_threads == 1


def test_the_embedded_model_on_cpu_computes_in_float32_under_auto():
    cfg = engine_config(ExtractOptions(data=()), Layout(), Path("/tiny"), "cpu", 4096, None)
    assert cfg.dtype == "float32"
    assert engine_config(ExtractOptions(data=(), model="m"), Layout(), Path("/m"), "cpu", 4096, None).dtype == "auto"


def test_the_embedded_model_and_the_compiled_kernels_are_kept_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("OFFLINE_EXTRACT_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    tiny = f"tiny-llama-v{TINY_VERSION}"
    for xdg, root in ((str(tmp_path / "xdg"), tmp_path / "xdg"), ("", tmp_path / "home" / ".cache")):
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)  # empty: unset, as the XDG spec reads it
        assert cache_root() == root / "offline_extract"
        for key in JIT_CACHES:  # set, then removed: monkeypatch restores what use_jit_cache sets
            monkeypatch.setenv(key, "elsewhere")
            monkeypatch.delenv(key)
        assert default_cache_dir() == root / "offline_extract" / tiny
        assert use_jit_cache()["TRITON_CACHE_DIR"] == str(root / "offline_extract" / "triton")
    monkeypatch.setenv("OFFLINE_EXTRACT_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine" / tiny


def test_image_threads_default_is_the_cores_up_to_the_bound_its_help_names(monkeypatch):
    """The default of --image-threads is stated once: MOST_IMAGE_THREADS bounds `default_image_threads` and is
    the number its help gives."""
    from offline_extract import options

    (cli,) = [f.metadata["cli"] for f in fields(ExtractOptions) if f.name == "image_threads"]
    assert cli.help.endswith(f"at most {options.MOST_IMAGE_THREADS}.")
    monkeypatch.setattr(options.os, "sched_getaffinity", lambda pid: set(range(options.MOST_IMAGE_THREADS + 5)))
    assert options.default_image_threads() == options.MOST_IMAGE_THREADS
    monkeypatch.setattr(options.os, "sched_getaffinity", lambda pid: {0, 1})
    assert options.default_image_threads() == 2


def test_the_tokenizing_processes_default_is_a_quarter_of_the_ranks_share_of_the_cores(monkeypatch):
    # A node of 8 GPUs under torchrun: each rank's 4 processes, 32 in all, each with its tokenizer's own threads
    # over every core, would crowd the forwards' own threads and the writers.
    from offline_extract.options import default_tokenizer_processes

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert [default_tokenizer_processes("cuda", False, ranks) for ranks in (1, 2, 4, 8, 16, 32)] == [4, 4, 4, 2, 1, 1]
    assert default_tokenizer_processes("cpu", False) == default_tokenizer_processes("cuda", True) == 0
