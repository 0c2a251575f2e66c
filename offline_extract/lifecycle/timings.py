"""Where a run's seconds went, from its timeline: the start-up to the first forward, ours and SGLang's, and the
tail after the last (`run_timings`, kept in the manifest), and that in the lines a run prints (`timing_line`).
"""

from __future__ import annotations

from typing import Callable

from offline_extract.formatting import plural
from offline_extract.lifecycle.host_use import host_use_line
from offline_extract.lifecycle.timeline import Timeline

Span = Callable[[str, str], float]  # the seconds between two marks of the timeline, 0 where one is missing


def run_timings(
    timeline: Timeline, dp_size: int, waits: dict, gate: Callable[[Span], dict], prebuild: Callable[[], dict]
) -> dict:
    """Where this rank's start-up and tail went, in seconds: from the command to the first forward (ours;
    SGLang's: the torch and SGLang imports, the model load and the warm-up; the parity gate), and from
    the last forward enqueued to the run's end (its states to the host, the last shards, under data
    parallelism the wait for the other replicas to finish theirs, rejects and index); `marks` holds every
    point of the timeline, counted from the interpreter's start. `gate` gives the parity gate's split
    (`ParityGate.timings`), `prebuild` what the engine compiled (`kernels.Compiles.report`), `waits` the hot
    loop's waits between forwards (`ExtractPhase.waits`).

    The tokenizer counts as ours only for the time the run waited for it: loaded beside SGLang's load
    (`tokenizer_beside_load`), what that covered is SGLang's; loaded before it, all of it."""
    marks = timeline.marks
    if "first forward" not in marks:  # no sample to extract
        return {"marks": marks}

    def span(first: str, then: str) -> float:
        return timeline.between(first, then) if first in marks and then in marks else 0.0

    # torch's import is timed where the command imports it (commands/extract.py); SGLang cannot run without it.
    sglang = {
        "torch_import_s": span("importing torch", "torch imported"),
        "sglang_import_s": span("loading", "sglang imported"),
        "model_load_s": span("sglang imported", "loaded"),
        "warm_up_s": span("loaded", "warm"),
    }
    beside = "tokenizer waited" in marks
    tokenizer_waited = span("warm", "tokenizer waited") if beside else span("tokenizer loading", "tokenizer loaded")
    startup, verify = marks["first forward"], span("verifying", "verified")
    ours = startup - sum(sglang.values()) - verify
    # Where the tail's rejects and index begin: once the other replicas were done too, if there were any.
    replicas = "replicas finished" if dp_size > 1 else "written"
    imports_and_checks = marks["checked"] - sglang["torch_import_s"]
    return {
        "startup_s": startup,
        "ours_s": ours,
        "imports_and_checks_s": imports_and_checks,
        "tokenizer_s": span("tokenizer loading", "tokenizer loaded"),
        "tokenizer_waited_s": tokenizer_waited,
        "tokenizer_beside_load": beside,
        "ours_other_s": ours - imports_and_checks - tokenizer_waited,
        "sglang_s": sum(sglang.values()),
        **sglang,
        "parity_gate_s": verify,
        **gate(span),
        "tail_s": timeline.between("last forward", "finished"),
        "to_host_s": timeline.between("last forward", "drained"),
        "last_shards_s": timeline.between("drained", "written"),
        **({"replicas_waited_s": timeline.between("written", replicas)} if replicas != "written" else {}),
        "rejects_and_index_s": timeline.between(replicas, "finished"),
        # Between the first forward and the last: the feed's wait for its next batch (feed._Input), and for
        # a free staging buffer, i.e. for the writer (HostOffload): a run bound by its host shows it here.
        **waits,
        **prebuild(),
        "marks": marks,
    }


def timing_line(t: dict) -> str:
    """`run_timings` in a few lines, one for each part: what a user waited for before the first forward and
    after the last."""
    if "startup_s" not in t:
        return f"start-up: no forward ran ({t['marks'].get('checked', 0.0):.1f} s of imports and checks)"
    # A rank that ran the reference says so however quick it was: a user who asked for --verify looks for it.
    ran = "gate_engine_s" in t or t["parity_gate_s"] >= 0.05
    gate = f"\n  parity gate {t['parity_gate_s']:.1f} s{_gate_words(t)}" if ran else ""
    prebuild = (
        f" (kernel prebuild {t['prebuild_s']:.1f} s, {t['prebuild_during_load_s']:.1f} s of it during the load)"
        if "prebuild_s" in t
        else ""
    )
    if t.get("triton_compiled"):
        prebuild += f" (Triton: {plural(t['triton_compiled'], 'kernel')} compiled in {t['triton_compile_s']:.1f} s)"
    if "routing_prebuild_s" in t:
        prebuild += (
            f" (MoE routing for {t['routing_prebuild_token_counts']} token counts {t['routing_prebuild_s']:.1f} s, "
            f"on {plural(t['routing_prebuild_processes'], 'compiler')})"
        )
    beside = " beside the load" if t["tokenizer_beside_load"] else ""
    waited = f"the other replicas {t['replicas_waited_s']:.2f} s, " if "replicas_waited_s" in t else ""
    return (
        f"start-up {t['startup_s']:.1f} s to the first forward:\n"
        f"  ours {t['ours_s']:.1f} s (imports and checks {t['imports_and_checks_s']:.1f} s, tokenizer "
        f"{t['tokenizer_waited_s']:.1f} s waited of its {t['tokenizer_s']:.1f} s{beside}, output directory and first "
        f"batch {t['ours_other_s']:.1f} s)\n"
        f"  SGLang's {t['sglang_s']:.1f} s (torch import {t['torch_import_s']:.1f} s, SGLang import "
        f"{t['sglang_import_s']:.1f} s, model load {t['model_load_s']:.1f} s, warm-up {t['warm_up_s']:.1f} s{prebuild})"
        f"{gate}\n"
        f"tail {t['tail_s']:.2f} s after the last forward: states to host {t['to_host_s']:.2f} s, last shards "
        f"{t['last_shards_s']:.2f} s, {waited}rejects and index {t['rejects_and_index_s']:.2f} s\n"
        f"between forwards, {t['input_wait_s']:.2f} s waited for input, {t['writer_wait_s']:.2f} s for the writer"
        f"{_host_use_words(t)}{_compiled_words(t)}"
    )


def _host_use_words(t: dict) -> str:
    """Where the host's cores went while the forwards ran (`HostUse`), where the run counted it."""
    return f"\n{host_use_line(t['host_use'])}" if "host_use" in t else ""


def _compiled_words(t: dict) -> str:
    """The kernels the warm-up missed (`Job._timings`): a run whose first batches compiled says so."""
    n = t.get("compiled_in_extraction", 0)
    return f"\n{plural(n, 'kernel cache file')} compiled during the extraction, not in the warm-up" if n else ""


def _gate_words(t: dict) -> str:
    """The parity gate's split (`ParityGate.timings`), where this rank ran HF's reference."""
    if "gate_hf_to_device_s" not in t:
        return ""
    if "gate_preload_s" in t:
        weights = (
            f"waited {t['gate_preload_waited_s']:.1f} s for its weights read beside the load in "
            f"{t['gate_preload_s']:.1f} s, "
        )
    else:
        weights = f"weights not read ahead ({t.get('gate_preload', 'no preload')}), "
    return (
        f" (engine {t['gate_engine_s']:.1f} s; HF: {weights}model class and config {t['gate_hf_config_s']:.1f} s, "
        f"weights to host {t['gate_hf_to_host_s']:.1f} s, to the device {t['gate_hf_to_device_s']:.1f} s, "
        f"forwards {t['gate_hf_forwards_s']:.1f} s, comparison {t['gate_compare_s']:.1f} s)"
    )
