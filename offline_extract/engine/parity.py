"""The parity gate: the engine's states against HF transformers on the same weights.

For every sample checked, aux layer id k must equal HF `hidden_states[k+1]` and the last state HF
`hidden_states[-1]` (after the final norm) or, for a pre-norm final state, the input of HF's final norm. A
drafter trained on misaligned states is worthless, so a mismatch stops the run before any GPU time is spent on extraction.

In half precision the reference is HF in float32, and the engine's states must be about as close to it as HF's
own half-precision states are (`HALF_FLOOR`).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Collection, Iterable, Mapping, Sequence, TypedDict

import torch

from offline_extract.data.images import Images
from offline_extract.engine.families import HFRouting, hf_routings


class Tolerance(TypedDict):
    max_abs: float | None
    max_rel: float | None  # of the states' scale
    min_cosine: float


# fp32 runs the same math in both stacks and must agree to rounding, and rounding scales with the values:
# the same states differ by a few float32 steps of their largest value (about 3e-7 of it), by how much
# depends on the CPU's GEMM blocking (an AMD EPYC's differs from an Intel Xeon's), so the bound is 1e-5 of
# the states' scale, where a layer off by one lands at 1e-2 or more. bf16 differs by accumulation order,
# so it is judged by direction (cosine) and by error relative to the states' own scale.
TOLERANCES: dict[str, Tolerance] = {
    "float32": {"max_abs": None, "max_rel": 1e-5, "min_cosine": 0.99999},
    "bfloat16": {"max_abs": None, "max_rel": 0.05, "min_cosine": 0.999},
    "float16": {"max_abs": None, "max_rel": 0.02, "min_cosine": 0.999},
}
# Half precision against HF in the same half precision cannot hold on a trained model: each stack rounds its own
# way, and both drift from the exact result by about as much, so the two stacks are further from each other than
# either is from float32 (docs/parity.md has the real model's figures). The engine is held instead
# to being about as close to HF's float32 states as HF's own half-precision states are, layer by layer, by each
# token's relative error against float32, |ours - fp32| / |fp32| (which sees a wrong scale, where a cosine does
# not): its median token's at most `factor` x HF's median token's plus `slack`, and likewise its worst token's.
# The median catches what moves every token (a layer off by one, a norm on the wrong side, a state 1% off); the
# worst, what breaks a few. Kernels round otherwise than HF (fused ops, accumulation order), hence the factors;
# `slack` covers layers where HF's half precision is near exact. A state 1% off is about as far from float32
# as bf16 rounding leaves it at depth, so the median's factor is tight, between where the real model's correct
# states and its nearest wrong ones land (docs/parity.md, benchmarks/gate_margin.py).
HALF_FLOOR = {
    "median": {"factor": 1.05, "slack": 5e-4},
    "worst": {"factor": 3.0, "slack": 1e-2},
}
# A mixture-of-experts model in half precision: a token whose router scores nearly tie can pick other
# experts in one stack than in the other, and the difference spreads to the tokens after it. Those
# tokens are right in both stacks, only different (docs/moe-bf16-investigation.md: with HF's expert choice
# forced, every token matches like a dense model). The gate there looks at the typical token: a layer
# off by one, or a routing or scaling convention gone wrong, moves the median token to a cosine of 0.98
# or below, while flips leave it above 0.999.
MOE_HALF_MIN_MEDIAN_COSINE = 0.995
# FP8 block-quantized weights (DeepSeek-V3, Qwen3-*-FP8) against HF on the same weights dequantized: SGLang
# also quantizes every projection's input to e4m3 (3 mantissa bits) at run time, so each GEMM differs from
# the reference by a few % and the difference grows with depth; any two W8A8 runs whose inputs differ by
# bf16 rounding drift as far apart, so no reference brings this back to the bf16 rule
# (docs/fp8-checkpoints.md, which has the figures). With SGLang's W8A8 reproduced in HF on the tiny checkpoints
# (tests/unit/engine/test_fp8.py) the right layer's median token stays above this bound and a layer off by one
# falls well below it, while the worst tokens do not tell them apart. So the median token is judged; MoE models
# with HF on the engine's experts, since FP8 noise flips many of the DeepSeek routing decisions.
FP8_MIN_MEDIAN_COSINE = 0.98


@dataclass(frozen=True)
class LayerParity:
    layer: str  # "aux k" or "last"
    hf_index: int  # index into HF output_hidden_states
    max_abs: float
    max_rel: float  # max_abs / max |HF state|
    cosine: float  # the worst per-token cosine similarity
    median_cosine: float  # the median token's
    # How far an off-by-one would land, which shows that the match above discriminates: the mean cosine
    # against HF hidden_states[i-1], and the smallest max-abs distance to hidden_states[i-1] or [i+1].
    neighbour_cosine: float
    neighbour_gap: float
    ok: bool
    # Each token's |ours - reference| / |reference|: the worst token's and the median token's.
    rel_err: float = 0.0
    median_rel_err: float = 0.0
    # In half precision (HALF_FLOOR) the reference is HF in float32, and these are HF's own half-precision states'
    # relative errors against it, worst and median (None: the reference is HF in the engine's dtype).
    floor_rel_err: float | None = None
    floor_median_rel_err: float | None = None

    def to_json(self) -> dict:
        return asdict(self)

    def floor_ratio(self) -> float | None:
        """How far the engine is from float32 in units of what HALF_FLOOR allows, the larger of the median's and
        the worst token's: at most 1 passes (None: no float32 reference)."""
        if self.floor_rel_err is None or self.floor_median_rel_err is None:
            return None
        pairs = {
            "median": (self.median_rel_err, self.floor_median_rel_err),
            "worst": (self.rel_err, self.floor_rel_err),
        }
        return max(
            ours / (HALF_FLOOR[key]["factor"] * floor + HALF_FLOOR[key]["slack"])
            for key, (ours, floor) in pairs.items()
        )


class ParityError(RuntimeError):
    pass


class ParityMismatch(ParityError):
    """The gate's verdict: the engine's states do not match HF's (where a ParityError may also be a reference
    that could not be had)."""


def _decoder(model):
    # get_decoder() finds the decoder by base_model_prefix, which on Llama4ForCausalLM names the multimodal
    # checkpoint's prefix ("language_model") instead of its `model` attribute, and returns the model itself.
    decoder = model.get_decoder()
    return decoder if hasattr(decoder, "norm") else decoder.model


def hf_image_inputs(model, images: Images, device) -> dict[str, torch.Tensor]:
    """What HF's vision-language class `model` takes beside the input ids for a sequence's images: the processor's
    outputs, its pixels in the model's dtype (as SGLang casts them; Llama 4's tower does not), and, for a model
    that reads it (Qwen's M-RoPE), mm_token_type_ids (1 at the image tokens) from the image token mask, which
    states the same as the processor's own, for a batch of one however the mask was stored."""
    dtype = next(model.parameters()).dtype
    inputs = {k: torch.as_tensor(v, device=device) for k, v in images.processor_outputs.items()}
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        inputs["mm_token_type_ids"] = torch.as_tensor(images.token_mask, device=device).long()[None]
    return inputs


def hf_hidden_states(
    model,
    input_ids: Sequence[int],
    device,
    final_state: str = "post-norm",
    keep: Collection[int] | None = None,
    images: Images | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """HF's hidden_states for one sequence (with its `images`, for a vision-language model); for a pre-norm
    final state the last one is replaced by the final norm's input (HF lists only the normed state), so that
    index -1 is the reference either way.

    With `keep`, only those indices are held, the others None: each decoder layer's output is taken as HF
    makes it, not HF's list of every layer's, which for a 131k-token sample of an 8B model takes 35 GB in
    bf16 and 70 GB in float32 beside the engine."""
    ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=device)[None]
    decoder = _decoder(model)
    seen: dict[int | str, torch.Tensor] = {}  # by hidden_states index, and the final norm's "pre" and "post"

    def taken(index):
        return lambda module, args, out: seen.__setitem__(index, out[0] if isinstance(out, tuple) else out)

    def first_input(layer, args, kwargs):
        # hidden_states[0] is what the first layer is given: the token embeddings, with a vision-language
        # model's image embeddings already in place of its image tokens' (the embedding table's output
        # holds the placeholders' rows).
        seen[0] = args[0] if args else kwargs["hidden_states"]

    hooks = [decoder.norm.register_forward_hook(lambda norm, args, out: seen.update(pre=args[0], post=out))]
    if keep is not None:
        hooks += [decoder.layers[0].register_forward_pre_hook(first_input, with_kwargs=True)] if 0 in keep else []
        hooks += [layer.register_forward_hook(taken(j + 1)) for j, layer in enumerate(decoder.layers) if j + 1 in keep]
    extra = hf_image_inputs(model, images, device) if images is not None else {}
    try:
        with torch.no_grad():
            # One position's logits, not every token's: a 131k-token sample's full-vocab logits would take
            # 34 GB beside the engine on the GPU, and the gate reads only hidden states.
            out = model(input_ids=ids, output_hidden_states=keep is None, use_cache=False, logits_to_keep=1, **extra)
    finally:
        for hook in hooks:
            hook.remove()
    if keep is None:
        states = tuple(h[0] for h in out.hidden_states)
    else:
        layers = len(decoder.layers)
        states = tuple(seen[i][0] if i in seen else None for i in range(layers)) + (seen["post"][0],)
    return states[:-1] + (seen["pre"][0],) if final_state == "pre-norm" else states


def reference_indices(layer_ids: Sequence[int], num_layers: int) -> set[int]:
    """The hidden_states indices the gate reads (compare_states): each aux layer's and its neighbours', and the
    final state's and the one before it."""
    return {k + d for k in layer_ids for d in (0, 1, 2)} | {num_layers - 1, num_layers}


@contextmanager
def float32_pass(model):
    """`model` (HF's, in half precision) computing in float32 on its own weights: each module's parameters are
    made float32 just before its forward and given back after, exactly (a half-precision value is a float32
    value), so that the float32 reference takes one module's float32 copy at a time beside the model, not a
    float32 model. Its input embeddings come out in float32, and every activation after them stays so."""

    def up(module, args):
        module._parity_half = [(p, p.data) for p in module.parameters(recurse=False)]
        for p, data in module._parity_half:
            p.data = data.float()

    def down(module, args, out):
        for p, data in module.__dict__.pop("_parity_half"):
            p.data = data

    owners = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    handles = [h for m in owners for h in (m.register_forward_pre_hook(up), m.register_forward_hook(down))]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
        for m in owners:  # a forward that raised left its parameters in float32
            for p, data in m.__dict__.pop("_parity_half", ()):
                p.data = data


def criterion(dtype: str, moe: bool, fp8: bool = False, floor: bool = False) -> str:
    if fp8:
        routed = " routed to the engine's experts" if moe else ""
        return (
            f"median-token cosine >= {FP8_MIN_MEDIAN_COSINE} (FP8 weights and activations in {dtype}, against "
            f"HF on the dequantized weights{routed})"
        )
    if floor:
        median, worst = HALF_FLOOR["median"], HALF_FLOOR["worst"]
        return (
            f"each token's relative error against HF in float32, at the median token at most {median['factor']} x "
            f"HF {dtype}'s own + {median['slack']}, at the worst token at most {worst['factor']} x HF {dtype}'s "
            f"own + {worst['slack']}"
        )
    if moe and dtype != "float32":
        return f"median-token cosine >= {MOE_HALF_MIN_MEDIAN_COSINE} (mixture of experts in {dtype})"
    tol = TOLERANCES[dtype]
    parts = [f"every token's cosine >= {tol['min_cosine']}"]
    parts += [f"max_abs <= {tol['max_abs']}"] if tol["max_abs"] is not None else []
    parts += [f"max_abs <= {tol['max_rel']} x the states' scale"] if tol["max_rel"] is not None else []
    return ", ".join(parts)


def judged_against_float32(dtype: str, moe: bool, fp8: bool) -> bool:
    """Whether the gate's reference is HF in float32 with HF's own `dtype` states as the floor (HALF_FLOOR): a
    dense model in half precision. FP8 keeps its rule (its W8A8 activations sit further from any reference
    than rounding: FP8_MIN_MEDIAN_COSINE), and so does a mixture of experts (MOE_HALF_MIN_MEDIAN_COSINE),
    which judges the median token against HF in the same dtype, a bound a real model's rounding stays far
    inside (SmolLM2-135M's median token: 0.9999)."""
    return dtype != "float32" and not fp8 and not moe


# Tokens of one state compared at a time (compare_states): its float32 copies, a few on the device at once,
# then take 128 MiB each at hidden size 4096, however long the sample.
COMPARE_TOKENS = 8192


def compare(
    engine_states: Sequence[tuple],
    hf_model,
    layer_ids: Sequence[int],
    dtype: str,
    moe: bool = False,
    final_state: str = "post-norm",
    fp8: bool = False,
    forcing: "ForcedRouting | None" = None,
    timed: Callable[[float], object] = lambda seconds: None,
    images: Sequence[Images | None] | None = None,
) -> list[LayerParity]:
    """engine_states: (input_ids, aux [T, k*H], last [T, H]) per sample, in the engine's compute dtype, and with
    `forcing` (set up on hf_model) a fourth item, the engine's experts {MoE layer: [T, k]}, which HF then takes.
    `images`, parallel to engine_states (None: all text), are each sample's images, which HF takes too.
    hf_model is in the engine's dtype; where the gate judges against float32 (`judged_against_float32`) it also
    runs in float32 on the same weights (`float32_pass`). `timed` is given each sample's HF forwards' seconds
    (to their end on the device)."""
    device = next(hf_model.parameters()).device
    exact = judged_against_float32(dtype, moe, fp8)
    keep = reference_indices(layer_ids, len(_decoder(hf_model).layers))

    def reference(ids, experts, im):
        if forcing is not None:
            forcing.set(experts[0])
        started = time.perf_counter()
        states = hf_hidden_states(hf_model, ids, device, final_state, keep, im)
        if exact:
            with float32_pass(hf_model):
                states = (hf_hidden_states(hf_model, ids, device, final_state, keep, im), states)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timed(time.perf_counter() - started)
        return states if exact else (states,)

    if images is not None and len(images) != len(engine_states):
        raise ValueError(f"{len(images)} image entries for {len(engine_states)} samples")
    pairs = (
        (aux, last, *reference(ids, experts, images[i] if images is not None else None))
        for i, (ids, aux, last, *experts) in enumerate(engine_states)
    )
    return compare_states(pairs, layer_ids, dtype, moe, final_state, fp8)


def compare_states(
    pairs: Iterable[tuple],
    layer_ids: Sequence[int],
    dtype: str,
    moe: bool = False,
    final_state: str = "post-norm",
    fp8: bool = False,
) -> list[LayerParity]:
    """(aux, last, HF hidden_states as hf_hidden_states returns them) per sample, or with a fourth item, HF's own
    half-precision hidden_states, where the third are HF's in float32 (HALF_FLOOR); folded one sample at a
    time so that long verifications never hold more than one sample's HF states.

    Computed where HF's states are (the GPU in a run; the engine's, held on the host, go there), COMPARE_TOKENS
    tokens at a time: only scalars and per-token figures come back. On the host, 8 samples of 2,000 tokens of an
    8B model took seconds (0.86 s a sample on one core of the development VM), after copying every HF state
    they read (4 GB) off the GPU."""
    last_name = "last" if final_state == "post-norm" else f"last ({final_state})"
    names = [f"aux {k}" for k in layer_ids] + [last_name]
    acc = {n: _StateFigures() for n in names}
    hf_index = {f"aux {k}": k + 1 for k in layer_ids}
    for aux, last, hs, *floor in pairs:
        floor_hs = floor[0] if floor else None
        hf_index[last_name] = len(hs) - 1
        ours = list(aux.chunk(len(layer_ids), dim=-1)) + [last]
        for name, whole in zip(names, ours):
            acc[name].fold(whole, hs, hf_index[name], floor_hs)
        # Dropped before the next sample's HF forward, which the loop's next step runs while `hs` still holds
        # this one's states (35 GB for a 131k-token sample of an 8B model).
        del aux, last, hs, floor, floor_hs, ours, whole
    rows = [acc[name].row(name, hf_index[name]) for name in names]
    return [dataclasses.replace(row, ok=_passes(row, dtype, moe, fp8)) for row in rows]


def _relative(mine: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return ((mine - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).cpu()


@dataclass
class _StateFigures:
    """One state's comparison with HF over the samples folded so far: the scalars as they stand, the per-token
    figures as the chunks they came in."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    cos: list = dataclasses.field(default_factory=list)
    rel: list = dataclasses.field(default_factory=list)
    floor: list = dataclasses.field(default_factory=list)
    ncos: list = dataclasses.field(default_factory=list)
    gap: float = float("inf")

    def fold(self, whole: torch.Tensor, hs: Sequence[torch.Tensor], i: int, floor_hs) -> None:
        """One sample's state [T, H] against HF's hidden_states[i] (and HF's own half-precision one in
        floor_hs, if given), COMPARE_TOKENS tokens at a time on HF's device."""
        cosine = torch.nn.functional.cosine_similarity
        device = hs[-1].device
        neighbours = [j for j in (i - 1, i + 1) if j < len(hs)]
        diff = scale = below = 0.0
        apart = dict.fromkeys(neighbours, 0.0)
        for start in range(0, len(whole), COMPARE_TOKENS):
            rows = slice(start, start + COMPARE_TOKENS)
            mine, ref = whole[rows].to(device).float(), hs[i][rows].float()
            diff = max(diff, (mine - ref).abs().max().item())
            scale = max(scale, ref.abs().max().item())
            self.cos.append(cosine(mine, ref, dim=-1).cpu())
            self.rel.append(_relative(mine, ref))
            if floor_hs is not None:
                self.floor.append(_relative(floor_hs[i][rows].float(), ref))
            below += cosine(mine, hs[i - 1][rows].float(), dim=-1).sum().item()
            for j in neighbours:
                apart[j] = max(apart[j], (mine - hs[j][rows].float()).abs().max().item())
        self.max_abs = max(self.max_abs, diff)
        self.max_rel = max(self.max_rel, diff / (scale or 1.0))
        self.ncos.append(below / len(whole))
        self.gap = min(self.gap, *apart.values())

    def row(self, name: str, hf_index: int) -> LayerParity:
        """The state's row, not yet judged (ok False)."""
        cos, rel = torch.cat(self.cos), torch.cat(self.rel)
        floor = torch.cat(self.floor) if self.floor else None
        return LayerParity(
            name,
            hf_index,
            self.max_abs,
            self.max_rel,
            cos.min().item(),
            cos.median().item(),
            sum(self.ncos) / len(self.ncos),
            self.gap,
            False,
            rel.max().item(),
            rel.median().item(),
            None if floor is None else floor.max().item(),
            None if floor is None else floor.median().item(),
        )


def _passes(row: LayerParity, dtype: str, moe: bool, fp8: bool = False) -> bool:
    if fp8:
        return row.median_cosine >= FP8_MIN_MEDIAN_COSINE
    if (ratio := row.floor_ratio()) is not None:
        return ratio <= 1
    if moe and dtype != "float32":
        return row.median_cosine >= MOE_HALF_MIN_MEDIAN_COSINE
    tol = TOLERANCES[dtype]
    max_abs, max_rel = tol["max_abs"], tol["max_rel"]
    ok = row.cosine >= tol["min_cosine"]
    ok &= max_abs is None or row.max_abs <= max_abs
    ok &= max_rel is None or row.max_rel <= max_rel
    return bool(ok)


def _figures(row: LayerParity, dtype: str) -> str:
    if row.floor_rel_err is None:
        return (
            f"max_abs={row.max_abs:.3g} max_rel={row.max_rel:.3g} cosine worst={row.cosine:.6f} "
            f"median={row.median_cosine:.6f}"
        )
    return (
        f"relative error vs HF float32 worst={row.rel_err:.3g} median={row.median_rel_err:.3g}, HF {dtype}'s own "
        f"worst={row.floor_rel_err:.3g} median={row.floor_median_rel_err:.3g} ({row.floor_ratio():.2f} x what "
        f"is allowed); cosine worst={row.cosine:.6f} median={row.median_cosine:.6f}"
    )


def check(rows: Sequence[LayerParity], dtype: str, num_samples: int, moe: bool = False, fp8: bool = False) -> None:
    bad = [r for r in rows if not r.ok]
    if bad:
        floor = any(r.floor_rel_err is not None for r in rows)
        lines = "\n".join(f"  {r.layer:>8} (HF hidden_states[{r.hf_index}]): {_figures(r, dtype)}" for r in bad)
        raise ParityMismatch(
            f"parity gate failed on {num_samples} samples in {dtype} (required: {criterion(dtype, moe, fp8, floor)}):\n"
            f"{lines}\nThe extracted states do not match HF transformers; refusing to write training data."
        )


def _softmax_then_top_k(block, logits, experts):
    # Qwen-MoE family: softmax over all experts in fp32, the chosen ones renormalized when norm_topk_prob is set.
    weights = torch.softmax(logits.float(), dim=-1).gather(1, experts)
    return weights / weights.sum(dim=-1, keepdim=True) if block.gate.norm_topk_prob else weights


def _sigmoid_scaled(block, logits, experts):
    # DeepSeek-V3 and GLM-4.5: sigmoid scores (the correction bias only chooses), renormalized, times
    # routed_scaling_factor.
    weights = logits.sigmoid().gather(1, experts)
    # Read from the config: transformers 5.19 keeps them on the block's router, 5.12 on the block.
    if block.config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * block.config.routed_scaling_factor


def _sigmoid_renormalized(block, logits, experts):
    # MiniMax-M2: fp32 sigmoid scores (the correction bias only chooses), always renormalized.
    weights = logits.float().sigmoid().gather(1, experts)
    return weights / weights.sum(dim=-1, keepdim=True)


def _top_k_then_softmax(block, logits, experts):
    # GPT-OSS: a softmax over the chosen experts' logits alone, in the logits' dtype.
    return torch.softmax(logits.gather(1, experts), dim=1, dtype=logits.dtype)


# How HF turns a block's router logits [T, E] into the weights of the chosen experts [T, k], by the name a
# family's `families.HFRouting` gives it.
SCORING: dict[str, Callable[[object, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "softmax_then_top_k": _softmax_then_top_k,
    "sigmoid_scaled": _sigmoid_scaled,
    "sigmoid_renormalized": _sigmoid_renormalized,
    "top_k_then_softmax": _top_k_then_softmax,
}
# HF transformers' sparse MoE blocks, by class name.
_HF_ROUTING = hf_routings()


@dataclass
class LayerRouting:
    layer: int  # decoder layer index
    tokens: int = 0
    # Tokens whose experts, as HF's own router picks them, differ from the forced ones.
    disagreements: int = 0
    # Where HF's own choice is the forced one, how far the weights computed here are from HF's own: zero up to
    # rounding shows that forcing computes what HF's router computes.
    weight_max_abs_diff: float = 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "disagreement_rate": self.disagreements / max(self.tokens, 1)}


class ForcedRouting:
    """HF's MoE blocks made to send every token to given experts: the engine's choice, so that two stacks
    whose bf16 router scores nearly tie for some token are compared on the same experts.

    The choice is the only thing replaced. The weights of the forced experts come from HF's own router
    logits through HF's own scoring (softmax before or after the top-k, or sigmoid; renormalization;
    routed_scaling_factor; `_HF_ROUTING`), and each block still records what HF would have chosen, so a
    routing that differs by more than near-ties (a wrong correction bias or grouping) shows as a high
    disagreement rate. Hooks stay until `remove`.
    """

    def __init__(self, hf_model):
        self._forced: Mapping[int, torch.Tensor] | None = None
        # HF's own choice in the last forward, per MoE layer: what it routes to when nothing is forced.
        self.own_choice: dict[int, torch.Tensor] = {}
        self.layers: dict[int, LayerRouting] = {}
        self._handles = []
        for name, block in hf_model.named_modules():
            routing = _HF_ROUTING.get(type(block).__name__)
            if routing is None:
                continue
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            self.layers[layer] = LayerRouting(layer)
            logits: dict = {}
            self._handles += [
                getattr(block, routing.router).register_forward_hook(
                    lambda m, args, out, logits=logits: logits.update(last=out[0] if isinstance(out, tuple) else out)
                ),
                block.experts.register_forward_pre_hook(
                    lambda m, args, block=block, layer=layer, logits=logits, routing=routing: self._force(
                        block, layer, routing, logits.pop("last"), args
                    )
                ),
            ]
        if not self.layers:
            raise ValueError(
                f"{type(hf_model).__name__} has no MoE block whose routing can be forced "
                f"(known: {', '.join(_HF_ROUTING)})"
            )

    @staticmethod
    def supports(hf_model) -> bool:
        return any(type(m).__name__ in _HF_ROUTING for m in hf_model.modules())

    def set(self, experts: Mapping[int, torch.Tensor] | None) -> None:
        """The experts of the next forward's tokens: {decoder layer: [T, experts per token]}; None lets HF route
        itself (recording its choice in own_choice)."""
        missing = sorted(set(self.layers) - set(experts)) if experts is not None else []
        if missing:
            raise ValueError(f"no forced experts for MoE layers {missing}")
        self._forced = experts

    def _force(self, block, layer: int, routing: HFRouting, logits: torch.Tensor, args: tuple) -> tuple | None:
        hidden, own_ids, own_weights = args
        self.own_choice[layer] = own_ids.detach().cpu()
        if self._forced is None:
            return None
        forced = self._forced[layer].to(own_ids.device)
        if forced.shape != own_ids.shape:
            raise ValueError(f"layer {layer}: forced experts {tuple(forced.shape)}, HF routes {tuple(own_ids.shape)}")
        # In the order HF's top-k lists them (best logit first), so that sums over the chosen experts add up in
        # HF's own order.
        forced = forced.gather(1, logits.gather(1, forced).argsort(dim=-1, descending=True))
        weights = SCORING[routing.scoring](block, logits, forced).to(own_weights.dtype)

        stats = self.layers[layer]
        own_order, forced_order = own_ids.sort(dim=-1), forced.sort(dim=-1)
        same = (own_order.values == forced_order.values).all(dim=-1)
        stats.tokens += len(same)
        stats.disagreements += int((~same).sum())
        if same.any():
            ours = weights.gather(1, forced_order.indices)[same].float()
            theirs = own_weights.gather(1, own_order.indices)[same].float()
            stats.weight_max_abs_diff = max(stats.weight_max_abs_diff, (ours - theirs).abs().max().item())
        return hidden, forced, weights

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
