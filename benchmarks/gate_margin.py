"""The parity gate's margin on a real model: how far the correct states sit inside its half-precision rule
(parity.HALF_FLOOR), and how far outside it each wrong state lands, per layer.

\b
    python benchmarks/gate_margin.py --model DIR --data corpus.jsonl [--samples 32] [--device cuda
        --attention-backend fa3] [--json FILE]

The engine (SGLang, in --dtype) captures --samples samples of the corpus, tokenized as an extraction does.
HF's model runs each sample in --dtype and in float32 on the same weights, as the gate runs it, for the
post-norm and the pre-norm final state. Then the gate's
own comparison (parity.compare_states) judges, against those references:

\b
    correct            the engine's states as captured
    ids -1, ids +1     every aux layer id off by one (aux k held against HF hidden_states[k] or [k+2])
    pre for post       the pre-norm final state given where the post-norm one is meant (HF's own, in --dtype:
                       the last decoder layer's output is not capturable as an aux layer)
    post for pre       the post-norm final state given where the pre-norm one is meant
    perturbed 1%       each captured state plus, per token, a random vector of 1% of that token's norm

Per layer, `ratio` is parity.LayerParity.floor_ratio (at most 1 passes); `margin` is the nearest wrong
state's ratio over the correct one's, and `wrong_all_fail` whether every wrong state failed.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import command_line, emit, program  # noqa: E402

from offline_extract.engine import parity, reference  # noqa: E402

PERTURBATION = 0.01  # of each token's norm


def corpus_samples(model: str, data: str, count: int) -> list[list[int]]:
    """The corpus's first `count` samples, tokenized as an extraction tokenizes them."""
    from transformers import AutoTokenizer

    from offline_extract.data.corpus import Record, read_corpus
    from offline_extract.data.tokenization import SampleTokenizer

    tokenize = SampleTokenizer(AutoTokenizer.from_pretrained(model), max_length=4096)
    samples = []
    for item in read_corpus([data]):
        sample = tokenize(item) if isinstance(item, Record) else None
        if sample is not None and hasattr(sample, "input_ids"):
            samples.append(sample.input_ids.tolist())
        if len(samples) == count:
            return samples
    raise click.ClickException(f"{data} gives {len(samples)} samples, not the {count} asked for")


def _perturbed(state: torch.Tensor, layers: int, generator: torch.Generator) -> torch.Tensor:
    """`state` ([T, layers x H]) with each layer's state of each token moved by PERTURBATION of its norm."""
    moved = []
    for part in state.float().chunk(layers, dim=-1):
        noise = torch.randn(part.shape, generator=generator)
        moved.append(part + noise * PERTURBATION * part.norm(dim=-1, keepdim=True) / noise.norm(dim=-1, keepdim=True))
    return torch.cat(moved, dim=-1).to(state.dtype)


def _both_final_states(hf, ids, device) -> dict:
    """HF's states with the post-norm final state (hf_hidden_states) and with the pre-norm one, from one forward."""
    seen = []
    hook = hf.get_decoder().norm.register_forward_hook(lambda norm, args, out: seen.append(args[0][0].cpu()))
    try:
        states = [h.cpu() for h in parity.hf_hidden_states(hf, ids, device)]
    finally:
        hook.remove()
    return {"post-norm": states, "pre-norm": states[:-1] + [seen[-1]]}


def _shifted(hs: list, by: int) -> list:
    """HF's states with every decoder layer's output moved `by` layers (aux k then meets HF hidden_states[k+1+by]),
    the final state left in place."""
    inner = list(hs[:-1])
    moved = [inner[0], *inner[:-1]] if by < 0 else [*inner[1:], hs[-1]]
    return [*moved, hs[-1]]


# Which rows each wrong state makes wrong: the ids' the aux layers, the norm's the final state.
WRONG_ROWS = {
    "ids -1": "aux",
    "ids +1": "aux",
    "perturbed 1%": "all",
    "pre for post": "last",
    "post for pre": "last",
}


def measure(model: str, data: str, samples: int, device: str, dtype: str, attention_backend: str | None) -> dict:
    from offline_extract.engine.distributed import free_port
    from offline_extract.engine.sglang_adapter import Engine, EngineConfig, prepare_process

    prepare_process(device)
    seqs = corpus_samples(model, data, samples)
    engine = Engine(
        EngineConfig(
            model_path=model,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            max_tokens_per_batch=8192,
            context_length=8192,
            nccl_port=free_port(),
            mem_fraction_static=0.5,
        )
    )
    default_ids = list(engine.layer_ids)
    captured, references = _captured_and_references(engine, reference.load_hf_model(model, dtype, device), seqs)
    generator = torch.Generator().manual_seed(0)

    def judged(shift=0, perturb=False, ours="post-norm", reference="post-norm"):
        """The gate's rows for the engine's states (its final state `ours`) against HF's (`reference`)."""
        pairs = []
        for (aux, last, pre), refs in zip(captured, references):
            final = last if ours == "post-norm" else pre
            exact, half = refs[reference]
            if shift:
                exact, half = _shifted(exact, shift), _shifted(half, shift)
            if perturb:
                aux, final = _perturbed(aux, len(default_ids), generator), _perturbed(final, 1, generator)
            pairs.append((aux, final, exact, half))
        return [
            r.to_json() | {"ratio": r.floor_ratio()}
            for r in parity.compare_states(iter(pairs), default_ids, dtype, final_state=reference)
        ]

    variants = {
        "correct": judged(),
        "ids -1": judged(shift=-1),
        "ids +1": judged(shift=1),
        "perturbed 1%": judged(perturb=True),
        "pre for post": judged(ours="pre-norm"),
        "post for pre": judged(reference="pre-norm"),
    }
    return {
        "model": model,
        "device": device,
        "dtype": dtype,
        "attention_backend": engine.attention_backend,
        "layer_ids": default_ids,
        "samples": len(seqs),
        "tokens": sum(map(len, seqs)),
        "rule": parity.HALF_FLOOR,
        "perturbation": PERTURBATION,
        "layers": _margins(variants),
        "variants": variants,
    }


def _captured_and_references(engine, hf, seqs: list[list[int]]) -> tuple[list, list]:
    """For each sample, the engine's (aux, post-norm last, HF's pre-norm last in float32) and HF's states in the
    engine's dtype and in float32, with the post-norm and the pre-norm final state."""
    hf_device = next(hf.parameters()).device
    captured, references = [], []
    for ids in seqs:
        c = engine.capture([ids])
        refs = {"post-norm": ([], []), "pre-norm": ([], [])}
        for kept, pass_ in ((1, contextlib.nullcontext), (0, lambda: parity.float32_pass(hf))):
            with pass_():
                both = _both_final_states(hf, ids, hf_device)
            for final_state, states in both.items():
                refs[final_state][kept].extend(states)
        captured.append((c.aux.cpu(), c.last.cpu(), refs["pre-norm"][1][-1]))
        references.append(refs)
    return captured, references


def _margins(variants: dict[str, list[dict]]) -> dict[str, dict]:
    """Per layer, the correct states' ratio to the rule beside each wrong state's that concerns the layer."""
    layers = {}
    for i, row in enumerate(variants["correct"]):
        name = row["layer"]
        wrong = {
            v: variants[v][i]["ratio"]
            for v, rows in WRONG_ROWS.items()
            if rows == "all" or (rows == "aux") == name.startswith("aux")
        }
        correct = row["ratio"]
        nearest = min(wrong, key=wrong.get)
        layers[name] = {
            "correct_ratio": correct,
            "nearest_wrong": nearest,
            "nearest_wrong_ratio": wrong[nearest],
            "margin": wrong[nearest] / correct,
            "wrong_ratios": wrong,
            "correct_passes": correct <= 1,
            "wrong_all_fail": all(r > 1 for r in wrong.values()),
        }
    return layers


@program(__doc__)
@click.option(
    "--model",
    required=True,
    help="A checkpoint directory (the real model: python -m offline_extract.testing.real_model --print-path).",
)
@click.option("--data", required=True, help="A corpus of real English (real_model --corpus FILE).")
@click.option("--samples", default=32, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float16"]), default="bfloat16", show_default=True)
@click.option("--attention-backend", default=None, help="SGLang's (default: the engine's own choice).")
@click.option("--json", "json_path", default=None, help="Also write the result to this file.")
def main(model, data, samples, device, dtype, attention_backend, json_path) -> None:
    result = measure(model, data, samples, device, dtype, attention_backend)
    emit({"command": command_line("python benchmarks/gate_margin.py"), **result}, json_path)


if __name__ == "__main__":
    main()
