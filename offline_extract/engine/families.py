"""Every model family the engine extracts, stated once (`FAMILIES`), and what the rest derives from it.

The engine reads its capture rules (`sglang_adapter.CAPTURE_RULES`), its CPU refusals, its image models
(`multimodal.IMAGE_MODELS`) and HF's MoE routing (`parity`) from here; the test suites read which families
they run where, and `benchmarks/parity_table.py` its rows. A family's random checkpoint is the builder of
the same name in `testing/models.py`. docs/adding-a-model.md says what a new family needs.

Nothing here imports SGLang or torch: the test rig reads this table too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

# A capture point p means "record the residual stream entering decoder layer p" (SGLang's
# `layers_to_capture`); storing HF hidden_states[k+1] for layer id k therefore needs capture point k+1.
# Each SGLang model file turns the ids handed to set_eagle3_layers_to_capture into capture points its own
# way, so every supported architecture names the inverse: which ids to pass for given capture points.
# Architectures absent here are refused rather than guessed.


def ids_adding_one(points: list[int]) -> list[int]:
    return [p - 1 for p in points]


def ids_for_deepseek(points: list[int]) -> list[int]:
    # deepseek_v2 adds +1 only when ids[0] == 1 and otherwise takes the ids as capture points. Passing the
    # points themselves is exact unless the first is 1; capture follows layer order, not list order, so a
    # leading 1 can go to the back. A lone point 1 cannot be expressed at all.
    if points[0] != 1:
        return list(points)
    if len(points) == 1:
        raise ValueError(
            "layer id 0 alone cannot be captured by SGLang's deepseek_v2 model file: its "
            "set_eagle3_layers_to_capture turns [1] into capture point 2 and [0] into capture point 0 "
            "(the embeddings), so an EAGLE-3 server could not feed a drafter trained on it either"
        )
    return points[1:] + [1]


@dataclass(frozen=True)
class CaptureRule:
    source: str  # where the model file's set_eagle3_layers_to_capture lives, in sglang/srt/models
    convention: str  # what that method does with the ids it is given
    ids_for_points: Callable[[list[int]], list[int]]
    # Qwen-MoE's decoder loop ignores `layers_to_capture` and asks each layer for an `_is_layer_to_capture`
    # attribute, which set_eagle3_layers_to_capture only ever sets, never clears.
    in_layer_flags: bool = False
    # Multimodal wrappers delegate capture to a causal LM held in this attribute; that LM owns the capture
    # switch, the decoder and the logits processor.
    language_model: str | None = None

    def causal_lm(self, model):
        return getattr(model, self.language_model) if self.language_model else model

    def captured_points(self, model) -> list[int]:
        """The capture points `model` is set to, read from where its decoder loop looks."""
        decoder = self.causal_lm(model).model
        if self.in_layer_flags:
            return [i for i, layer in enumerate(decoder.layers) if getattr(layer, "_is_layer_to_capture", False)]
        return sorted(decoder.layers_to_capture)


@dataclass(frozen=True)
class HFRouting:
    """How HF transformers' sparse MoE block of a family routes, so that `parity.ForcedRouting` can send its
    tokens to the experts SGLang chose: the block's class, the submodule computing its router logits, and how
    HF turns those logits into the chosen experts' weights (a key of `parity.SCORING`)."""

    block: str
    scoring: str
    router: str = "gate"


@dataclass(frozen=True)
class ImageModel:
    """How one vision-language architecture's SGLang file takes an image: the processor output it
    reads as the item's feature, the ones it keeps beside it, and the ones that only restate the tokens."""

    source: str  # the SGLang model file and the processor class that serves it
    feature: str
    beside: tuple[str, ...]
    restating: tuple[str, ...] = ()
    # The config's fields naming the tokens either side of an image, as the SGLang processor hands them on.
    markers: tuple[str, str] = ("vision_start_token_id", "vision_end_token_id")
    # M-RoPE (Qwen): the sequence's positions come from the token ids and each image's image_grid_thw, which also
    # splits the feature's rows among the images. Otherwise the positions are the text's, and each row of the
    # feature (a Llama 4 tile) fills one run of image tokens.
    mrope: bool = False
    # The weight names' prefixes (tower, projector) that the SGLang file builds its tower from only where the
    # checkpoint's index names weights under them (mllama4.py's _has_vision_weights); otherwise it runs the model
    # text-only, and an image chat's forward fails inside SGLang.
    indexed_tower: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    name: str  # its random checkpoint (testing/models.py), its results' files and the tests' ids
    label: str  # as the parity record names it
    sglang_class: str  # the class SGLang serves the checkpoint's `architectures` with
    sglang_module: str  # the file under sglang/srt/models defining that class (the capture checks import it)
    capture: CaptureRule
    # Its HF MoE block, whose routing --verify forces onto the experts SGLang chose; None for a dense family
    # (and for Llama 4, whose top-1 MoE HF runs without a forceable block).
    routing: HFRouting | None = None
    # Why SGLang 0.5.17 cannot run it on the CPU; None: it can, and the CPU suite holds it against HF.
    not_on_cpu: str | None = None
    # The engine refuses it on the CPU with that reason before the weights load, where SGLang's own error
    # would come only after loading, naming a module of the shimmed sgl_kernel.
    refused_on_cpu: bool = False
    gpu_backends: tuple[str, ...] | None = None  # the attention backends SGLang runs it on, where not all
    images: ImageModel | None = None  # how its image inputs are built, for a family whose images are extracted
    images_refused: str | None = None  # why a vision-language family's image records are refused
    quantized: str | None = None  # the quantized release format the GPU suite checks it in ("fp8", "mxfp4")
    # Further random checkpoints of the same class, on another path of it, that the CPU suite runs too.
    variants: tuple[str, ...] = ()
    # Where its attention hands q and k to SGLang's QK-norm (models/utils.py apply_qk_norm), whose nvcc-built
    # module the start-up builds ahead: "always", or the text config's flag that turns the norms on.
    qk_norm: str | None = None

    def __post_init__(self):
        if self.refused_on_cpu and not self.not_on_cpu:
            raise ValueError(f"{self.name}: a CPU refusal needs its reason in not_on_cpu")


_PLUS_ONE = "adds +1 to every id"


def _plus_one(source: str, **kwargs) -> CaptureRule:
    return CaptureRule(source, _PLUS_ONE, ids_adding_one, **kwargs)


def _deepseek(source: str, **kwargs) -> CaptureRule:
    return CaptureRule(
        source, "adds +1 to every id only if ids[0] == 1, else uses the ids verbatim", ids_for_deepseek, **kwargs
    )


def _qwen_moe(name: str, label: str, sglang_class: str, source: str, block: str, **kwargs) -> Family:
    # The Qwen-MoE files capture through per-layer flags; HF's blocks softmax over all experts, then take the top k.
    return Family(
        name,
        label,
        sglang_class,
        name,
        _plus_one(source, in_layer_flags=True),
        routing=HFRouting(block, "softmax_then_top_k"),
        **kwargs,
    )


def _refused_on_cpu(reason: str) -> dict:
    return dict(not_on_cpu=reason, refused_on_cpu=True)


_DEEPSEEK_ROUTING = HFRouting("DeepseekV3MoE", "sigmoid_scaled")
_SINKS = (
    "SGLang runs its attention sinks on triton, trtllm_mha and fa3/fa4 only (server_args.py:5349), none a CPU backend"
)
_CHUNKED = "SGLang implements its chunked attention in the fa3 backend only, so the engine refuses the others"
# Qwen's processors (Qwen2VLImageProcessor behind Qwen2.5-VL's and Qwen3-VL's) return each image's patches
# flattened, all images' rows concatenated, with one [t, h, w] grid row per image; mm_token_type_ids marks
# the image tokens, which the token ids already do.
_qwen_vl = partial(
    ImageModel, feature="pixel_values", beside=("image_grid_thw",), restating=("mm_token_type_ids",), mrope=True
)

# In the parity record's order.
FAMILIES = (
    Family("llama", "Llama 2/3", "LlamaForCausalLM", "llama", _plus_one("llama.py:885")),
    Family("qwen3", "Qwen3", "Qwen3ForCausalLM", "qwen3", _plus_one("qwen3.py:688"), quantized="fp8", qk_norm="always"),
    Family("qwen2", "Qwen2, Qwen2.5", "Qwen2ForCausalLM", "qwen2", _plus_one("qwen2.py:747")),
    Family("mistral", "Mistral", "MistralForCausalLM", "mistral", _plus_one("llama.py:885 (inherited)")),
    _qwen_moe(
        "qwen3_moe",
        "Qwen3-MoE",
        "Qwen3MoeForCausalLM",
        "qwen3_moe.py:1073, flags set in qwen2_moe.py:891",
        "Qwen3MoeSparseMoeBlock",
        qk_norm="always",
    ),
    _qwen_moe(
        "qwen2_moe",
        "Qwen2-MoE",
        "Qwen2MoeForCausalLM",
        "qwen2_moe.py:1203, flags set in qwen2_moe.py:891",
        "Qwen2MoeSparseMoeBlock",
        **_refused_on_cpu(
            "its shared expert's sigmoid gate is applied by a fused Triton kernel (fused_gate_sigmoid_mul_add, "
            "qwen2_moe.py:590) on every platform but AMX and NPU, and Triton has no CPU driver here"
        ),
    ),
    _qwen_moe(
        "qwen3_next",
        "Qwen3-Next",
        "Qwen3NextForCausalLM",
        "qwen3_next.py:1263, flags set in qwen3_next.py:926",
        "Qwen3NextSparseMoeBlock",
        **_refused_on_cpu(
            "its hybrid linear-attention backend imports causal_conv1d_update_cpu from sgl_kernel.mamba "
            "(layers/attention/linear/kda_backend.py:31), a CPU operator the CUDA sgl-kernel wheel does not have"
        ),
    ),
    Family(
        "minimax_m2",
        "MiniMax-M2",
        "MiniMaxM2ForCausalLM",
        "minimax_m2",
        _plus_one("minimax_m2.py:1254"),
        routing=HFRouting("MiniMaxM2SparseMoeBlock", "sigmoid_renormalized"),
        **_refused_on_cpu(
            "its QK norm sums squares over all heads in a Triton kernel that asserts CUDA tensors "
            "(rms_sumsq_serial, minimax_m2.py:205)"
        ),
    ),
    Family(
        "glm4_moe",
        "GLM-4.5",
        "Glm4MoeForCausalLM",
        "glm4_moe",
        _plus_one("glm4_moe.py:1446"),
        routing=HFRouting("Glm4MoeMoE", "sigmoid_scaled"),
        qk_norm="use_qk_norm",
    ),
    # Ids whose largest equals the layer count pass verbatim there; the ids passed here stay below N - 1.
    Family(
        "gpt_oss",
        "GPT-OSS",
        "GptOssForCausalLM",
        "gpt_oss",
        CaptureRule("gpt_oss.py:1328", _PLUS_ONE + " unless the largest id is N", ids_adding_one),
        routing=HFRouting("GptOssMLP", "top_k_then_softmax", router="router"),
        not_on_cpu=_SINKS,
        gpu_backends=("triton", "fa3"),
        quantized="mxfp4",
    ),
    # Its processor returns each image's tiles of pixels (the tiles, then the whole image as a global tile where
    # there are several), all images' tiles concatenated; each tile's patch tokens form one run.
    Family(
        "llama4",
        "Llama 4 (text and images)",
        "Llama4ForConditionalGeneration",
        "mllama4",
        _plus_one(
            "mllama4.py:983, delegating to llama.py:885 (inherited by llama4.py's Llama4ForCausalLM)",
            language_model="language_model",
        ),
        not_on_cpu=_CHUNKED,
        gpu_backends=("fa3",),
        images=ImageModel(
            "mllama4.py, served by mllama4.py's Mllama4ImageProcessor",
            feature="pixel_values",
            beside=(),
            markers=("boi_token_id", "eoi_token_id"),
            indexed_tower=("vision_model.", "multi_modal_projector."),
        ),
        qk_norm="use_qk_norm",
    ),
    # Kimi-K2 runs on the same classes; its single expert group takes another path of the routing.
    Family(
        "deepseek_v3",
        "DeepSeek-V3, Kimi-K2",
        "DeepseekV3ForCausalLM",
        "deepseek_v2",
        _deepseek("deepseek_v2.py:3134 (inherited)"),
        routing=_DEEPSEEK_ROUTING,
        quantized="fp8",
        variants=("kimi_k2",),
    ),
    # HF loads Kimi-K2.5 as the DeepSeek-V3 of its text_config, as the product's gate does.
    Family(
        "kimi_k25",
        "Kimi-K2.5 (text)",
        "KimiK25ForConditionalGeneration",
        "kimi_k25",
        _deepseek("kimi_k25.py:920, delegating to deepseek_v2.py:3134", language_model="language_model"),
        routing=_DEEPSEEK_ROUTING,
        images_refused="HF transformers has no class for its MoonViT tower (the release ships it as remote "
        "code), so no parity gate against HF can hold its image tokens' states, and none are "
        "stored unchecked",
    ),
    # Text records and image chats, held against HF's own vision-language class.
    Family(
        "qwen2_5_vl",
        "Qwen2.5-VL (text and images)",
        "Qwen2_5_VLForConditionalGeneration",
        "qwen2_5_vl",
        _plus_one("qwen2_5_vl.py:897"),
        images=_qwen_vl("qwen2_5_vl.py, served by qwen_vl.py's QwenVLImageProcessor"),
    ),
    # Its decoder loop records a layer's output before adding the DeepStack features that the next layer
    # takes (qwen3_vl.py:1164 and 1174), as HF records hidden_states before adding them.
    Family(
        "qwen3_vl",
        "Qwen3-VL (text and images)",
        "Qwen3VLForConditionalGeneration",
        "qwen3_vl",
        _plus_one("qwen3_vl.py:1542"),
        images=_qwen_vl("qwen3_vl.py, served by qwen_vl.py's QwenVLImageProcessor"),
        qk_norm="always",
    ),
)

BY_NAME = {f.name: f for f in FAMILIES}


def cpu_models() -> dict[str, Family]:
    """The random checkpoints the CPU suite runs, by name (a family's variants included)."""
    return {name: f for f in FAMILIES if f.not_on_cpu is None for name in (f.name, *f.variants)}


def hf_routings() -> dict[str, HFRouting]:
    """Every HF MoE block whose routing can be forced, by class name."""
    return {f.routing.block: f.routing for f in FAMILIES if f.routing}
