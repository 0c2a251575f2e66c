"""The parity gate of one rank (`--verify N`): each replica's first N samples, captured by the engine, held against
HF's model of the checkpoint before extraction spends any time (`engine/parity`). Every rank takes part, and every
rank stops if any replica fails. The reference's weights are read beside the model's load where the host has room
(`start_preload`), and the gate's seconds are split for the run's timings (`timings`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from offline_extract.data.tokenization import Sample
from offline_extract.engine import checkpoint, parity, reference
from offline_extract.engine.distributed import Coordinator, Layout
from offline_extract.engine.sglang_adapter import Engine
from offline_extract.formatting import plural
from offline_extract.lifecycle.progress import foreign_output_hidden, note
from offline_extract.lifecycle.timeline import Timeline
from offline_extract.lifecycle.timings import Span
from offline_extract.options import ExtractOptions


def parity_lines(rows: list[dict]) -> list[str]:
    def floor(row: dict) -> str:
        if row.get("floor_rel_err") is None:
            return ""
        return (
            f", relative error median {row['median_rel_err']:.3g} worst {row['rel_err']:.3g} (HF's own "
            f"{row['floor_median_rel_err']:.3g}, {row['floor_rel_err']:.3g})"
        )

    return [
        f"parity {row['layer']:>8} vs HF{' float32' if row.get('floor_rel_err') is not None else ''} "
        f"hidden_states[{row['hf_index']}]: max_abs {row['max_abs']:.3g} cosine worst {row['cosine']:.6f} "
        f"median {row['median_cosine']:.6f}{floor(row)} {'ok' if row['ok'] else 'FAIL'}"
        for row in rows
    ]


def _available_host_memory() -> int | None:
    """The host memory available to new allocations without swapping (Linux's MemAvailable), in bytes; None
    where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class ParityGate:
    """One rank's part of the gate: the read-ahead of HF's weights (`start_preload`, before the model loads), the
    verdict (`run`, once it has), and where its seconds went (`timings`)."""

    def __init__(self, opts: ExtractOptions, layout: Layout, coord: Coordinator, timeline: Timeline, model_path: Path):
        self.opts, self.layout, self.coord, self.timeline, self.model_path = opts, layout, coord, timeline, model_path
        # The HF reference's weights read beside the load (`start_preload`), and what was decided about it and
        # what the gate's HF forwards took, for `timings`.
        self.preload: reference.ReferencePreload | None = None
        self.preload_figures: dict = {}
        self.hf_forwards_s = 0.0

    def start_preload(self) -> None:
        """--verify on a rank that runs HF (the writing one): the reference's weights start to be read into host
        memory now, beside SGLang's import, load and warm-up (`reference.ReferencePreload`), where the host has
        room for every such rank's copy; otherwise HF reads the files at the gate."""
        if not (self.opts.parity_samples and self.layout.writes):
            return
        model = str(self.model_path)
        if not checkpoint.checkpoint_files(model):
            self.preload_figures = {"gate_preload": "none: no safetensors files, HF reads the checkpoint at the gate"}
            return
        nbytes = checkpoint.checkpoint_bytes(model)
        readers = self.layout.local_world_size // self.layout.tp_size  # the writing ranks on this host
        refusal = reference.preload_refusal(nbytes, readers, _available_host_memory())
        self.preload_figures = {
            "gate_preload": f"skipped: {refusal}" if refusal else "beside the load",
            "gate_preload_bytes": nbytes,
        }
        if refusal is None:
            self.preload = reference.ReferencePreload(model, mark=self.timeline.mark).start()

    def run(self, engine: Engine, head: list[Sample]) -> dict:
        """--verify N: the gate on each replica's first N samples (nothing without --verify): its rows and, on a
        MoE model, how HF was routed, for the run's metadata; the leader prints the rows."""
        verified = self.judge(engine, head) if self.opts.parity_samples else {"rows": []}
        if self.layout.leads:
            for line in parity_lines(verified["rows"]):
                note(line)
            asked = self.opts.parity_samples
            if len(head) < asked:  # a gate on fewer samples than asked passes as easily: say so
                who = "this replica" if self.layout.dp_size > 1 else "the run"
                note(
                    f"parity gate: {plural(len(head), 'sample')} compared of the {asked} --verify asked for: {who} "
                    f"had no more to extract"
                )
        return verified

    def judge(self, engine: Engine, head: list[Sample]) -> dict:
        """Parity gate on each replica's first samples, before extraction spends any time. Every rank takes
        part, and every rank stops if any replica fails: a TP peer left running would wait in NCCL forever.

        On a MoE model HF is sent to the experts the engine chose (parity.ForcedRouting) where SGLang exposes
        them and HF's MoE block is one that can be forced, so that near-tied router scores, which bf16 and FP8
        rounding resolve differently in the two stacks, do not compare a token on two different experts; how
        often HF's own router would have chosen otherwise is recorded."""
        layout, mark = self.layout, self.timeline.mark
        preload, self.preload = self.preload, None
        states = []
        for s in head:
            if engine.is_moe:
                with engine.recording_routing() as chosen:
                    c = engine.capture([s.input_ids], [s.images])
                # A sample longer than one forward's budget is routed chunk by chunk.
                experts = {
                    layer: None if any(i is None for i in ids) else torch.cat(ids) for layer, ids in chosen.items()
                }
            else:
                c, experts = engine.capture([s.input_ids], [s.images]), {}
            states.append((s.input_ids.tolist(), c.aux.cpu(), c.last.cpu(), experts))
        mark("gate captured")
        fp8 = checkpoint.is_fp8_block(engine.quantization)
        result: dict = {"rows": []}
        failure = error = None
        # Which replica failed, where there are several to tell apart; a run of one has no replicas to its user.
        where = f"dp replica {layout.dp_rank}: " if layout.dp_size > 1 else ""
        if layout.writes and head:
            # Whatever stops this rank here is told to every rank at the meeting below, where they wait: they
            # would otherwise learn of its exit, without the cause, from torchrun's SIGTERM on its node and
            # from its missing heartbeat, 30 s later, on the others.
            try:
                rows, result = self._reference(engine, states, [s.images for s in head], preload, fp8)
            except Exception as e:  # the reference's weights unreadable, HF failing to load or run them
                said = str(e) if isinstance(e, parity.ParityError) else f"{type(e).__name__}: {e}"
                failure, error = (f"{where}{said}", False), e
            else:
                try:
                    parity.check(rows, engine.dtype, len(head), moe=engine.is_moe, fp8=fp8)
                except parity.ParityMismatch as e:
                    failure = (f"{where}{e}", True)
        elif preload is not None:
            preload.drop()
        # (what was said, whether it is the gate's verdict on the states) from each rank that failed
        failures = [f for f in self.coord.all_gather(failure) if f]
        if error is not None:
            raise error  # this rank's own, as it was raised
        if failures:
            said, verdict = failures[0]
            raise (parity.ParityMismatch if verdict else parity.ParityError)(said)
        return result

    def _reference(
        self, engine: Engine, states: list, images: list, preload: reference.ReferencePreload | None, fp8: bool
    ) -> tuple[list, dict]:
        """HF's model of the checkpoint (on the weights read beside the load, where they were) run on the gate's
        samples (with their `images`) and held against the engine's `states`: the rows, and the gate's result for
        the metadata."""
        mark = self.timeline.mark
        tensors = preload.take() if preload is not None else None
        mark("hf loading")
        with foreign_output_hidden(not self.opts.verbose):
            hf = reference.load_hf_model(
                str(self.model_path), engine.dtype, str(engine.device), tensors=tensors, mark=mark
            )
        del tensors  # the host's copy goes once HF's model is on the device
        exposed = all(experts and all(ids is not None for ids in experts.values()) for _, _, _, experts in states)
        forcing = parity.ForcedRouting(hf) if engine.is_moe and exposed and parity.ForcedRouting.supports(hf) else None
        forwards: list[float] = []
        try:
            rows = parity.compare(
                states,
                hf,
                engine.layer_ids,
                engine.dtype,
                moe=engine.is_moe,
                final_state=engine.final_state,
                fp8=fp8,
                forcing=forcing,
                timed=forwards.append,
                images=images,
            )
        finally:
            if forcing is not None:
                forcing.remove()
        mark("hf compared")
        self.hf_forwards_s = sum(forwards)
        del hf
        if torch.device(engine.device).type == "cuda":
            torch.cuda.empty_cache()  # once, so HF's weights do not shrink the extraction's activation room
        result: dict = {"rows": [r.to_json() for r in rows]}
        if engine.is_moe:
            result["routing"] = [layer.to_json() for layer in forcing.layers.values()] if forcing else "not forced"
        return rows, result

    def timings(self, span: Span) -> dict:
        """Where the parity gate's seconds went on this rank (nothing without --verify): the engine's forwards
        of the samples, the wait for the reference's weights read beside the load (`gate_preload`: whether
        they were, and why not; `gate_preload_s` that read's own seconds), HF's model class and config, its
        weights to the host and to the device, its forwards and the comparison; the rest (freeing HF, the
        verdicts of every replica) is `gate_other_s`."""
        marks = self.timeline.marks
        if "gate captured" not in marks:
            return {}
        gate = {"gate_engine_s": span("verifying", "gate captured"), **self.preload_figures}
        if "parity preload read" in marks:
            gate["gate_preload_s"] = span("parity preload started", "parity preload read")
        last = "gate captured"
        if "hf compared" in marks:  # this rank ran HF's reference
            gate.update(
                gate_preload_waited_s=span("gate captured", "hf loading"),
                gate_hf_config_s=span("hf loading", "hf configured"),
                gate_hf_to_host_s=span("hf configured", "hf on host"),
                gate_hf_to_device_s=span("hf on host", "hf on device"),
                gate_hf_forwards_s=self.hf_forwards_s,
                gate_compare_s=span("hf on device", "hf compared") - self.hf_forwards_s,
            )
            last = "hf compared"
        gate["gate_other_s"] = span(last, "verified")
        return gate
